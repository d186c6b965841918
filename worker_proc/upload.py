"""Host arrays to the device in one copy per step.

Every step needs a handful of small index arrays on the device (token ids, positions, KV
slots, ...). Copying each from pageable memory costs one transfer each and may make the
driver wait for the stream, which would stall the host behind the GPU and defeat overlapped
scheduling. ``Uploader`` packs the arrays of one step into one pinned buffer and issues one
asynchronous copy; the device tensors it returns are views into a device buffer.

Both sides are rings: a pinned buffer is reused only after the event recorded behind its
copy has completed (normally long ago), and a device view stays valid until ``ring_size``
further uploads have been made. Callers that keep tensors longer ask for ``persistent``
ones, which own fresh device memory. On the CPU the same code runs without pinning or
events, so its packing is tested there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 16  # bytes; every array starts at a multiple, so typed views of the buffer work

_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


def _round_up(num_bytes: int) -> int:
    return -(-num_bytes // _ALIGN) * _ALIGN


def _typed(buffer: torch.Tensor) -> dict[np.dtype, torch.Tensor]:
    """Views of a uint8 buffer as every supported dtype, made once (slicing is cheap)."""
    return {np_dtype: buffer.view(dtype) for np_dtype, dtype in _TORCH_DTYPES.items()}


class _Slot:
    """One pinned host buffer and its device buffer, with typed views of both."""

    def __init__(self, num_bytes: int, device: torch.device, pin: bool) -> None:
        num_bytes = _round_up(max(num_bytes, _ALIGN))
        self.host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
        host_bytes = self.host.numpy()
        self.host_typed = {np_dtype: host_bytes.view(np_dtype) for np_dtype in _TORCH_DTYPES}
        self.device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.device_typed = _typed(self.device)
        self.event = torch.cuda.Event() if pin else None

    @property
    def num_bytes(self) -> int:
        return self.host.numel()


class Uploader:
    def __init__(self, device: torch.device, ring_size: int = 8, initial_bytes: int = 1 << 16):
        self.device = device
        self._pin = device.type == "cuda"
        self._ring = [_Slot(initial_bytes, device, self._pin) for _ in range(ring_size)]
        self._next = 0

    def upload(self, arrays: Sequence[np.ndarray], persistent: bool = False) -> list[torch.Tensor]:
        """Copy ``arrays`` (numpy arrays of int64, int32, float32 or bool) to the device;
        returns one tensor per array, of the same dtype and shape."""
        offsets, total = [], 0
        for array in arrays:
            offsets.append(total)
            total += _round_up(array.nbytes)
        index = self._next
        self._next = (index + 1) % len(self._ring)
        slot = self._ring[index]
        if slot.event is not None:
            slot.event.synchronize()  # its previous copy has left the pinned buffer
        if slot.num_bytes < total:
            # The old device buffer may still be read by queued kernels; the caching
            # allocator orders its reuse behind them on this stream.
            slot = self._ring[index] = _Slot(max(total, 2 * slot.num_bytes), self.device, self._pin)
        for array, offset in zip(arrays, offsets):
            if array.size:
                start = offset // array.itemsize
                slot.host_typed[array.dtype][start : start + array.size] = array.reshape(-1)
        if persistent:
            device = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=self.device)
            device_typed = _typed(device)
        else:
            device, device_typed = slot.device, slot.device_typed
        if total:
            device[:total].copy_(slot.host[:total], non_blocking=True)
        if slot.event is not None:
            slot.event.record()
        views = []
        for array, offset in zip(arrays, offsets):
            start = offset // array.itemsize
            view = device_typed[array.dtype][start : start + array.size]
            views.append(view if array.ndim == 1 else view.view(array.shape))
        return views
