"""Naming the Triton compiles that happen after start-up.

Start-up compiles every kernel variant the worker's graphs and warm-up launch
(kernels/compile_ahead.py). A variant first launched later, by a shape or a path start-up
did not run, compiles (or loads from Triton's disk cache) inside the step that launched it,
and that step, with every request in it, waits: from tens of milliseconds for a cached one
to seconds for a fresh one. ``watch_late_compiles`` hooks Triton's JIT so that each such
compile is logged as a warning with the kernel's name and what it cost, and counted, so that
a stall in a process's timeline has a name.

Triton calls ``knobs.runtime.jit_cache_hook`` before it compiles a variant missing from a
kernel's in-memory cache and ``jit_post_compile_hook`` after; a Triton without the knobs
(or the CPU path, which never imports Triton) is not watched.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from kernels.backend import _triton_available, load_triton

logger = logging.getLogger(__name__)


@dataclass
class LateCompiles:
    """The compiles seen since ``watch_late_compiles``: (kernel, milliseconds) each."""

    name: str
    compiles: list[tuple[str, float]] = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)

    def before_compile(self, **hook_args: Any) -> None:
        self._local.started = time.perf_counter()

    def after_compile(self, **hook_args: Any) -> None:
        started = getattr(self._local, "started", None)
        self._local.started = None
        ms = (time.perf_counter() - started) * 1e3 if started is not None else float("nan")
        kernel = kernel_name(hook_args)
        self.compiles.append((kernel, ms))
        logger.warning(
            "%s: Triton compiled a variant of %s after start-up, in %.0f ms; the step that "
            "launched it waited (%d late compiles so far); variant: %s",
            self.name,
            kernel,
            ms,
            len(self.compiles),
            variant(hook_args),
        )

    def summary(self) -> str:
        if not self.compiles:
            return "no Triton compiles after start-up"
        total = sum(ms for _, ms in self.compiles)
        kernels = ", ".join(sorted({kernel for kernel, _ in self.compiles}))
        return f"{len(self.compiles)} Triton compiles after start-up, {total:.0f} ms: {kernels}"


def kernel_name(hook_args: dict[str, Any]) -> str:
    """The kernel's function name from a JIT hook's arguments (its ``fn``, else ``repr``)."""
    fn = hook_args.get("fn")
    name = getattr(fn, "name", None) or getattr(getattr(fn, "fn", None), "__name__", None)
    if name:
        return str(name)
    return str(hook_args.get("repr", "?")).split("[", 1)[0]


def variant(hook_args: dict[str, Any]) -> str:
    """What tells this variant from the kernel's others: each argument's type as Triton
    specialized it (``i32/16``: known divisible by 16; a constant: its value) and the launch
    options, from the hook's ``compile`` record, so that the shape or path start-up missed
    can be found. Without that record, the hook's ``repr``."""
    record = hook_args.get("compile")
    if not isinstance(record, dict) or not isinstance(record.get("signature"), dict):
        return str(hook_args.get("repr", "?"))
    signature: dict[str, Any] = record["signature"]
    configs = record.get("configs") or [{}]
    attrs = configs[0] if isinstance(configs[0], dict) else {}
    constants = record.get("constants") or {}
    parts = []
    for index, (name, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            value = constants.get(name, constants.get((index,), "?"))
            parts.append(f"{name}={value}")
            continue
        hints = str(attrs.get((index,), ""))
        parts.append(f"{name}: {kind}" + ("/16" if "tt.divisibility" in hints else ""))
    options = f"num_warps={record.get('num_warps')}, num_stages={record.get('num_stages')}"
    return f"({', '.join(parts)}) [{options}]"


_watch: LateCompiles | None = None


def watch_late_compiles(name: str, runtime: Any = None) -> LateCompiles | None:
    """Log every Triton compile of this process from now on (see the module docstring);
    ``name`` labels the lines. Hooks chain to any hook already set. Returns the watch, or
    None where Triton is absent or has no JIT hooks. ``runtime``: Triton's
    ``knobs.runtime`` (tests pass a stand-in)."""
    global _watch
    if runtime is None:
        if not _triton_available():
            return None
        runtime = getattr(getattr(load_triton(), "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    if _watch is not None:
        return _watch
    watch = LateCompiles(name)
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def on_cache_miss(**hook_args: Any) -> Any:
        watch.before_compile(**hook_args)
        # A true return would tell Triton to skip the compile: only an earlier hook decides.
        return before(**hook_args) if before is not None else None

    def on_compiled(**hook_args: Any) -> Any:
        watch.after_compile(**hook_args)
        return after(**hook_args) if after is not None else None

    runtime.jit_cache_hook = on_cache_miss
    runtime.jit_post_compile_hook = on_compiled
    _watch = watch
    return watch


def late_compiles() -> LateCompiles | None:
    """The process's watch, if one was started."""
    return _watch
