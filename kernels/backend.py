"""Which implementation of a kernel runs for a given tensor, and lazy Triton loading.

Every kernel module holds a plain PyTorch reference (``*_ref``), a Triton variant
(``*_triton``) and a public dispatch function that asks ``use_triton``, so that CPU tensors,
and machines without Triton, keep running the references. ``PEGAINFER_KERNELS=ref`` or
``PEGAINFER_DISABLE_TRITON=1`` forces the references everywhere, which is how a suspected
kernel bug is bisected.

Triton stays optional and is never imported on the CPU path: kernel bodies are decorated
with ``triton_jit``, which only records the plain function. ``load_triton()`` (called by
every ``*_triton`` wrapper before its first launch) imports Triton, binds ``tl`` in each
kernel module and replaces every recorded function by its ``triton.jit`` version under the
same global name, so kernels calling helper kernels resolve them at compile time as usual.
Set ``TRITON_INTERPRET=1`` before the first ``load_triton()`` to run kernels on CPU.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

import torch

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

logger = logging.getLogger(__name__)

_pending: list[Callable[..., Any]] = []
_lock = threading.Lock()
_triton: ModuleType | None = None


def _disabled_by_env() -> bool:
    if os.environ.get("PEGAINFER_KERNELS", "").lower() == "ref":
        return True
    return os.environ.get("PEGAINFER_DISABLE_TRITON", "") not in ("", "0")


@functools.cache
def _triton_available() -> bool:
    if _disabled_by_env():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """True when a Triton variant may run on ``tensor``'s device."""
    return tensor.is_cuda and _triton_available()


def triton_jit(fn: _Fn | None = None, *, do_not_specialize: tuple[str, ...] = ()) -> Any:
    """Mark ``fn`` as a Triton kernel, compiled by ``triton.jit`` at ``load_triton()``.

    Its module must define ``tl = None`` at top level (rebound to ``triton.language``) and
    use ``from __future__ import annotations`` so ``tl.constexpr`` is not evaluated early.
    ``@triton_jit(do_not_specialize=("num_tokens",))`` keeps Triton from compiling a new
    variant when such an argument turns 1 or a multiple of 16: for arguments that vary from
    step to step, so that serving never stops to compile.
    """
    if fn is None:
        return functools.partial(triton_jit, do_not_specialize=do_not_specialize)
    if do_not_specialize:
        fn.__pegainfer_do_not_specialize__ = list(do_not_specialize)  # type: ignore[attr-defined]
    with _lock:
        if _triton is None:
            _pending.append(fn)
            return fn
    # Triton already loaded (a module imported late): compile-wrap right away.
    return _bind(fn)


def _bind(fn: Callable[..., Any]) -> Any:
    assert _triton is not None
    scope = fn.__globals__
    scope["tl"] = _triton.language
    jitted = _triton.jit(fn, do_not_specialize=getattr(fn, "__pegainfer_do_not_specialize__", None))
    scope[fn.__name__] = jitted
    return jitted


def load_triton() -> ModuleType:
    """Import Triton and turn every recorded kernel into a ``triton.jit`` function."""
    global _triton
    with _lock:
        if _triton is None:
            import triton
            import triton.language  # noqa: F401

            _triton = triton
        pending, _pending[:] = list(_pending), []
        for fn in pending:
            _bind(fn)
        return _triton


def warm_up_triton() -> None:
    """Pay, ahead of the first launch, what it would: Triton's import, the kernels' binding
    and Triton's cache key (a hash of its own sources and library, some 0.4 s). Safe to run
    in a background thread (the worker runs it while the weights load); the hash releases
    the GIL."""
    try:
        if not _triton_available():
            return
        load_triton()
        try:
            from triton.runtime.cache import triton_key
        except ImportError:  # where another Triton version keeps it
            from triton.compiler.compiler import triton_key
        triton_key()
    except Exception:  # only a warm-up: the first launch reports a real failure
        logger.warning("Triton warm-up failed", exc_info=True)


def dot_needs_fp32(dtype: torch.dtype) -> bool:
    """True when ``tl.dot`` must get float32 operands: Triton's CPU interpreter multiplies
    bfloat16 tiles as their raw uint16 bits. Never true on a GPU."""
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "") == "1"


def output_rows(
    out: torch.Tensor | None, num_rows: int, n: int, like: torch.Tensor
) -> torch.Tensor:
    """``out`` checked to be a ``[num_rows, n]`` tensor of ``like``'s dtype and device with
    a unit last stride (rows may be spaced wider), or a fresh one."""
    if out is None:
        return torch.empty((num_rows, n), dtype=like.dtype, device=like.device)
    if out.shape != (num_rows, n) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}, want "
            f"({num_rows}, {n}) {like.dtype} on {like.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError("out needs a unit last stride")
    return out


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (used to size split grids)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return False
    if os.environ.get("PEGAINFER_PDL", "1") in ("0", "false", "off"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def use_pdl(tensor: torch.Tensor) -> bool:
    """True when Triton kernels on ``tensor``'s device launch with programmatic dependent
    launch (kernels/pdl.py): a CUDA device of compute capability 9.0 or later, outside
    Triton's interpreter, unless ``PEGAINFER_PDL=0``."""
    return tensor.is_cuda and _pdl_supported(tensor.device.index or 0)


@functools.cache
def _weight_eviction(setting: str) -> str:
    if setting not in ("0", "1"):
        raise ValueError(f"PEGAINFER_EVICT_WEIGHTS must be 0 or 1, got {setting!r}")
    return "evict_first" if setting == "1" else ""


def weight_eviction() -> str:
    """The L2 eviction policy of the linear kernels' weight loads: ``evict_first``, so that
    the 8 GB a decode step streams through L2 leave the small tensors the step reads back
    (activations, the residual stream, norm slots, attention partials, the KV cache at
    short contexts) resident; plain loads with ``PEGAINFER_EVICT_WEIGHTS=0``. On an H200 a
    Qwen3-4B step at context 128 / 4k took 2.38 / 2.66 ms against 2.41 / 2.68
    (tools/MEASUREMENTS.md). Triton 3.6 drops the hint from loads it pipelines through shared
    memory (``cp.async``), so it reaches only unpipelined K loops."""
    return _weight_eviction(os.environ.get("PEGAINFER_EVICT_WEIGHTS", "1"))
