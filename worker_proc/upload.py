"""Host arrays to the device in one copy per step.

Every step needs a handful of small index arrays on the device (token ids, positions, KV
slots, ...). Copying each from pageable memory costs one transfer each and may make the
driver wait for the stream, which would stall the host behind the GPU and defeat overlapped
scheduling. ``Uploader`` packs the arrays of one step into one pinned buffer and issues one
asynchronous copy (a kernel reading the pinned buffer: kernels/host_copy.py); the device
tensors it returns are views into a device buffer.

Both sides are rings: a pinned buffer is reused only after the event recorded behind its
copy has completed (normally long ago), and a device view stays valid until ``ring_size``
further uploads have been made. Callers that keep tensors longer ask for ``persistent``
ones, which own fresh device memory. On the CPU the same code runs without pinning or
events, so its packing is tested there.

A decode step's arrays keep their dtypes and shapes from one step to the next, so the views
of a slot's buffers that one set of shapes needs are made once and kept (``_Placement``):
slicing tensors costs more than filling and copying a step's few hundred bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kernels.host_copy import copy_pinned

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
    """Views of a uint8 buffer as every supported dtype, made once."""
    return {np_dtype: buffer.view(dtype) for np_dtype, dtype in _TORCH_DTYPES.items()}


def _offsets(arrays: Sequence[np.ndarray]) -> tuple[list[int], int]:
    """Each array's byte offset in a packed buffer, and the buffer's length."""
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += _round_up(array.nbytes)
    return offsets, total


def _views(
    typed: dict[np.dtype, Any], arrays: Sequence[np.ndarray], offsets: list[int]
) -> list[Any]:
    """The 1-D spans of a buffer's typed views where the arrays go."""
    views = []
    for array, offset in zip(arrays, offsets):
        start = offset // array.itemsize
        views.append(typed[array.dtype][start : start + array.size])
    return views


def _shaped(views: list[torch.Tensor], arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
    return [v if a.ndim == 1 else v.view(a.shape) for v, a in zip(views, arrays)]


class _Slot:
    """One pinned host buffer and its device buffer, with typed views of both."""

    # Placements kept per slot; a serving worker sees a few shapes over and over.
    MAX_PLACEMENTS = 32

    def __init__(self, num_bytes: int, device: torch.device, pin: bool) -> None:
        num_bytes = _round_up(max(num_bytes, _ALIGN))
        self.host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
        host_bytes = self.host.numpy()
        self.host_typed = {np_dtype: host_bytes.view(np_dtype) for np_dtype in _TORCH_DTYPES}
        self.device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        self.device_typed = _typed(self.device)
        self.event = torch.cuda.Event() if pin else None
        self.placements: dict[tuple, _Placement] = {}

    @property
    def num_bytes(self) -> int:
        return self.host.numel()

    def fill(self, arrays: Sequence[np.ndarray], host_views: list[np.ndarray]) -> None:
        for host, array in zip(host_views, arrays):
            if array.size:
                host[:] = array if array.ndim == 1 else array.reshape(-1)

    def placement(self, signature: tuple, arrays: Sequence[np.ndarray]) -> _Placement:
        """Where arrays of this signature go in this slot (the slot is big enough)."""
        placement = self.placements.get(signature)
        if placement is None:
            if len(self.placements) >= self.MAX_PLACEMENTS:
                self.placements.clear()
            offsets, total = _offsets(arrays)
            placement = self.placements[signature] = _Placement(
                _views(self.host_typed, arrays, offsets),
                _shaped(_views(self.device_typed, arrays, offsets), arrays),
                self.host[:total],
                self.device[:total],
            )
        return placement


class _Placement:
    """The views of a slot that arrays of one signature (dtypes and shapes, in order) use:
    the host spans to fill, the device tensors to return, and the bytes to copy."""

    __slots__ = ("host_views", "device_views", "host_span", "device_span")

    def __init__(
        self,
        host_views: list[np.ndarray],
        device_views: list[torch.Tensor],
        host_span: torch.Tensor,
        device_span: torch.Tensor,
    ) -> None:
        self.host_views = host_views
        self.device_views = device_views
        self.host_span = host_span
        self.device_span = device_span


class Uploader:
    def __init__(self, device: torch.device, ring_size: int = 8, initial_bytes: int = 1 << 16):
        self.device = device
        self._pin = device.type == "cuda"
        self._ring = [_Slot(initial_bytes, device, self._pin) for _ in range(ring_size)]
        self._next = 0

    def upload(self, arrays: Sequence[np.ndarray], persistent: bool = False) -> list[torch.Tensor]:
        """Copy ``arrays`` (numpy arrays of int64, int32, float32 or bool) to the device;
        returns one tensor per array, of the same dtype and shape."""
        index = self._next
        self._next = (index + 1) % len(self._ring)
        slot = self._ring[index]
        if slot.event is not None:
            slot.event.synchronize()  # its previous copy has left the pinned buffer
        signature = tuple([(array.dtype, array.shape) for array in arrays])
        placement = slot.placements.get(signature)
        if placement is None:
            total = _offsets(arrays)[1]
            if slot.num_bytes < total:
                # The old device buffer may still be read by queued kernels; the caching
                # allocator orders its reuse behind them on this stream.
                slot = self._ring[index] = _Slot(
                    max(total, 2 * slot.num_bytes), self.device, self._pin
                )
            placement = slot.placement(signature, arrays)
        slot.fill(arrays, placement.host_views)
        if persistent:
            views = self._copy_to_fresh_memory(arrays, placement.host_span)
        else:
            views = list(placement.device_views)
            if len(placement.device_span):
                copy_pinned(placement.device_span, placement.host_span)
        if slot.event is not None:
            slot.event.record()
        return views

    def _copy_to_fresh_memory(
        self, arrays: Sequence[np.ndarray], host_span: torch.Tensor
    ) -> list[torch.Tensor]:
        """Device tensors that outlive the ring: views of a buffer of their own."""
        total = len(host_span)
        device = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=self.device)
        if total:
            device[:total].copy_(host_span, non_blocking=True)
        return _shaped(_views(_typed(device), arrays, _offsets(arrays)[0]), arrays)
