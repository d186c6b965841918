"""Writing a safetensors file whose tensors are made while it is written, for the random
checkpoints of tools/make_tiny_checkpoint.py: a 30 GB checkpoint never has to fit memory."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def write_safetensors(
    path: str,
    specs: list[tuple[str, tuple[int, ...], torch.dtype]],
    make: Callable[[str], torch.Tensor],
    pool: ThreadPoolExecutor,
) -> int:
    """Write one safetensors file whose tensors ``make(name)`` produces, in parallel.

    The header is written first from the shapes alone, so every tensor's place in the file
    is known before it exists: each is generated and written at its offset by a pool thread
    and dropped, and memory holds only the tensors in flight. Returns the data bytes.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    places = []
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        places.append((name, offset, nbytes))
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    data_start = 8 + len(encoded)

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, data_start + offset)
        _pwrite_all(fd, struct.pack("<Q", len(encoded)) + encoded, 0)

        def write_one(place: tuple[str, int, int]) -> None:
            name, start, nbytes = place
            tensor = make(name).contiguous().cpu()
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            if raw.nbytes != nbytes:
                raise RuntimeError(f"{name}: made {raw.nbytes} bytes, expected {nbytes}")
            _pwrite_all(fd, memoryview(raw), data_start + start)

        for _ in pool.map(write_one, places):
            pass
    finally:
        os.close(fd)
    return offset


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        # One write moves at most ~2 GiB on Linux; loop until all of it is down.
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written
