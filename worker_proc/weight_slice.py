"""A checkpoint tensor that is read only when, and only as much as, a layer asks for it.

The loader hands each parameter's ``weight_loader`` a ``WeightSlice`` instead of a tensor.
A sharded layer calls ``narrow`` (or indexes with slices) for its rank's range, and only
those bytes are read from the safetensors file: with tensor parallelism every rank reads
its own shard, never the whole tensor. A replicated parameter reads everything.

Anything else done with it as if it were a tensor (``torch.cat``, ``.t()``, ``copy_``)
reads the whole tensor first, so a model family whose loader reshapes weights still works,
just without the saving.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

TORCH_DTYPES = {  # safetensors dtype names
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class WeightSlice:
    """One checkpoint tensor, unread. ``shape``/``dtype`` come from the file's header;
    ``narrow``, ``[...]`` with slices and ``materialize`` read on ``device``."""

    def __init__(
        self,
        name: str,
        raw_slice: Any,
        read_all: Callable[[], torch.Tensor],
        device: torch.device,
        read_rows: Callable[[int, int], torch.Tensor] | None = None,
    ) -> None:
        """``read_rows(start, length)``, when given, reads a range of the first dimension
        (contiguous in the file) on ``device`` by a faster path than ``raw_slice``."""
        self.name = name
        self._slice = raw_slice
        self._read_all = read_all
        self._read_rows = read_rows
        self.device = device
        self.shape = torch.Size(raw_slice.get_shape())
        self.dtype = TORCH_DTYPES.get(raw_slice.get_dtype())
        self.elements_read = 0  # how much of it has been read so far (tests, logging)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"WeightSlice({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def _done(self, tensor: torch.Tensor) -> torch.Tensor:
        self.elements_read += tensor.numel()
        return tensor.to(self.device)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % self.ndim
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(
                f"{self.name}: [{start}, {start + length}) is outside dim {dim} of "
                f"{tuple(self.shape)}"
            )
        if self._read_rows is not None and (dim == 0 or (start, length) == (0, self.shape[dim])):
            # All of a later dimension (a row-parallel weight on one rank) is all the rows.
            return self._done(self._read_rows(start, length) if dim == 0 else self._whole())
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._done(self._slice[index])

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows = _leading_rows(index, self.shape)
        if rows is not None and self._read_rows is not None:
            return self._done(self._read_rows(*rows))
        return self._done(self._slice[index])

    def materialize(self) -> torch.Tensor:
        if self._read_rows is not None and self.ndim > 0:
            return self._done(self._whole())
        return self._done(self._read_all())

    def _whole(self) -> torch.Tensor:
        return self._read_rows(0, self.shape[0])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def read(value: Any) -> Any:
            return value.materialize() if isinstance(value, WeightSlice) else value

        return func(*tree_map(read, args), **tree_map(read, kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        # Tensor methods not defined here (view, t, to, ...) act on the whole tensor.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)


def _leading_rows(index: Any, shape: torch.Size) -> tuple[int, int] | None:
    """``(start, length)`` when ``index`` selects a range of the first dimension and all of
    the others (``t[a:b]``, ``t[a:b, :]``), else None."""
    parts = index if isinstance(index, tuple) else (index,)
    if not parts or len(parts) > len(shape):
        return None
    first, rest = parts[0], parts[1:]
    if not isinstance(first, slice) or first.step not in (None, 1):
        return None
    if any(part != slice(None) for part in rest):
        return None
    start, stop, _ = first.indices(shape[0])
    return start, max(stop - start, 0)


def read_whole(loaded: torch.Tensor | WeightSlice) -> torch.Tensor:
    """The full tensor, whichever of the two ``loaded`` is."""
    return loaded.materialize() if isinstance(loaded, WeightSlice) else loaded
