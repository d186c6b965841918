"""Reads checkpoint bytes onto a GPU through page-locked staging buffers.

safetensors' own reader returns pageable host tensors, which reach the GPU through the
driver's pageable path: one thread copies the bytes out of the file mapping, then the driver
copies them again into its own staging memory, at a few GB/s. Here several threads
``pread`` a range of the file straight into a page-locked buffer (the kernel copies from the
page cache, with no faults on a mapping and the GIL released), and the buffer goes to the GPU
with an asynchronous copy while the threads fill the next one.

``SafetensorsFile`` parses a shard's header (8-byte little-endian length, then JSON of
``{name: {dtype, shape, data_offsets}}``) so that a tensor's rows map to a byte range.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from worker_proc.cuda_context import register_host_memory, unregister_host_memory

BUFFER_BYTES = 64 << 20
NUM_BUFFERS = 4
# Each thread's share of a buffer; smaller shares only add syscalls.
MIN_PIECE_BYTES = 4 << 20


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of the tensor's bytes
    end: int

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return (self.end - self.begin) // max(rows, 1)


class SafetensorsFile:
    """The tensor table of one shard, and an open descriptor for reading it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            (header_len,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
            header = json.loads(os.pread(self.fd, header_len, 8))
        except Exception:
            os.close(self.fd)
            raise
        data_start = 8 + header_len
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            self.entries[name] = TensorEntry(
                name, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end
            )

    def names_in_file_order(self) -> list[str]:
        return sorted(self.entries, key=lambda name: self.entries[name].begin)

    def close(self) -> None:
        os.close(self.fd)


class _Staging:
    """A buffer of anonymous memory, page-locked with the driver when ``pinned``.

    Not ``torch.empty(pin_memory=True)``: torch's pinned-memory cache hands a block back to
    the system only once its copies are known to be done, and a worker that kept one would
    carry it, resident, for its whole life. A registered mapping is unregistered and unmapped
    at ``release``, deterministically."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        self._memory = mmap.mmap(-1, nbytes)
        self.tensor = torch.frombuffer(self._memory, dtype=torch.uint8)
        self.view = memoryview(self._memory)
        self.copied: torch.cuda.Event | None = None  # the last copy out of this buffer
        # Unregistered, the copies still work: the driver stages pageable memory itself.
        self._registered = pinned and register_host_memory(self.tensor.data_ptr(), nbytes)

    def release(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        if self._registered:
            unregister_host_memory(self.tensor.data_ptr())
        del self.tensor
        self.view.release()
        self._memory.close()


class PinnedReader:
    """Reads byte ranges of files into new uint8 tensors on ``device``: a CUDA device, or
    the CPU (no page-locking, no events; the same reading path, for tests).

    Use as a context manager: leaving it waits for the copies in flight and gives the
    page-locked buffers back to the system (they would otherwise stay in the idle worker's
    resident memory)."""

    def __init__(
        self,
        device: torch.device,
        buffer_bytes: int = BUFFER_BYTES,
        num_buffers: int = NUM_BUFFERS,
        num_threads: int | None = None,
        min_piece_bytes: int = MIN_PIECE_BYTES,
    ) -> None:
        self.device = device
        self.buffer_bytes = buffer_bytes
        self.num_threads = num_threads or min(8, os.cpu_count() or 1)
        self.min_piece_bytes = min_piece_bytes
        self._on_cuda = device.type == "cuda"
        if self._on_cuda:
            # The buffers are page-locked for the CUDA context current on this thread: make
            # it torch's (any runtime call that needs the context does).
            torch.cuda.synchronize(device)
        self._buffers = [_Staging(buffer_bytes, self._on_cuda) for _ in range(num_buffers)]
        self._next = 0
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="weights-read")

    def __enter__(self) -> PinnedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown()  # no read may still be writing into a buffer
        for staging in self._buffers:
            staging.release()
        self._buffers.clear()

    def read(self, fd: int, offset: int, nbytes: int) -> torch.Tensor:
        """``nbytes`` of the file at ``offset``, as a uint8 tensor on the device. Returns
        once the bytes are queued for the device (on the current stream)."""
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        done = 0
        while done < nbytes:
            count = min(self.buffer_bytes, nbytes - done)
            staging = self._buffers[self._next]
            self._next = (self._next + 1) % len(self._buffers)
            if staging.copied is not None:
                staging.copied.synchronize()  # its previous copy must be out before reuse
            self._pread(fd, offset + done, staging.view[:count])
            out[done : done + count].copy_(staging.tensor[:count], non_blocking=self._on_cuda)
            if self._on_cuda:
                staging.copied = torch.cuda.Event()
                staging.copied.record()
            done += count
        return out

    def _pread(self, fd: int, offset: int, target: memoryview) -> None:
        size = len(target)
        pieces = max(1, min(self.num_threads, size // self.min_piece_bytes))
        step = -(-size // pieces)
        ranges = [(start, min(start + step, size)) for start in range(0, size, step)]
        if len(ranges) == 1:
            _pread_exact(fd, offset, target)
            return
        futures = [
            self._pool.submit(_pread_exact, fd, offset + start, target[start:end])
            for start, end in ranges
        ]
        for future in futures:
            future.result()


def _pread_exact(fd: int, offset: int, target: memoryview) -> None:
    done = 0
    while done < len(target):
        count = os.preadv(fd, [target[done:]], offset + done)
        if count <= 0:
            raise OSError(f"unexpected end of file at offset {offset + done}")
        done += count
