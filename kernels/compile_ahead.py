"""Compiling the Triton kernels a stretch of code will launch, in parallel, before it runs.

At start-up the worker runs the model's forward at every captured graph size, and each
Triton kernel variant compiles the first time it is launched: one after another, most of
the start-up time when Triton's cache is empty. Inside ``compile_ahead()`` no Triton launch
runs. Each computes its variant's key as usual and, where that variant is not compiled yet,
hands the compile to a thread pool (Triton's asynchronous compile mode). On exit every
compile has finished and sits in its kernel's cache, so the same code run again launches
compiled kernels. A compile spends most of its time outside the GIL (MLIR and LLVM passes,
ptxas), so the threads overlap. Each thread also builds its kernel's launcher, a C module
Triton compiles per signature at a kernel's first launch (one C compiler run each with an
empty cache), so that the first launch only loads it. A variant submitted once is filed at
once, as its pending compile, so that the block's later launches of it cost only their key.

Where the OS can fork, each thread forks a child that compiles the kernel and builds its
launcher into Triton's disk cache, then loads both from there: Triton generates a kernel's
first IR in Python and holds the GIL through parts of its passes, so threads alone overlap
poorly (on an H200 host 16 threads took longer than 8). The child only compiles and writes
files, and leaves with ``os._exit``; it makes no CUDA call, so the parent's CUDA context
does not matter to it. A child that fails leaves the compile to its thread, which then
raises the real error (kernels/compile_child.py). ``PEGAINFER_COMPILE_FORK=0`` compiles in
the threads themselves.

The caught pass itself costs a second or two (a forward at every graph size), which is all
it costs once Triton's disk cache holds the kernels. ``compile_for`` therefore notes each
finished pass in that cache under a ``fingerprint`` of everything that picks the variants,
and skips a pass already noted.

The caught stretch sees uninitialised outputs from its Triton kernels, so it must not let
what they write steer the host: a decode or prefill forward qualifies, since it never reads
device values back. ``available()`` is false where this cannot work: no Triton, Triton's
interpreter, or a Triton without the asynchronous mode (the kernels then compile at their
first launch, one after another). ``PEGAINFER_COMPILE_AHEAD=0`` turns it off as well.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernels import compile_child
from kernels.backend import _triton_available, load_triton

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Compiling in threads, more than 8 took longer (the GIL); forked children each hold their own.
MAX_THREADS = 8
MAX_FORKED = 16
_active = threading.Lock()
# Variables of the environment that pick no kernel; the launcher's pid differs every run.
_NOT_KERNEL_SETTINGS = frozenset(
    {
        "PEGAINFER_PARENT_PID",
        "PEGAINFER_CACHE",
        "PEGAINFER_COMPILE_THREADS",
        "PEGAINFER_COMPILE_FORK",
        "PEGAINFER_BYTECODE_CACHE",
        "PEGAINFER_BYTECODE_FILL",
    }
)


@dataclass
class CompileAheadReport:
    """What one ``compile_ahead`` block did."""

    threads: int
    forked: bool = False  # each compile ran in a child process of its thread
    launches: int = 0  # Triton launches caught
    variants: int = 0  # kernel variants not yet compiled in this process, compiled now
    seconds: float = 0.0  # from entering the block to the last compile's end
    run_seconds: float = 0.0  # from entering the block to the end of its body (the caught run)
    last_found: float = 0.0  # from entering the block to the last new variant's submission
    # (seconds from entering the block, kernel name) of each new variant, in the order found
    found: list[tuple[float, str]] = field(default_factory=list)
    longest: float = 0.0  # seconds of the longest compile, with its launcher
    forking: float = 0.0  # seconds spent in fork(), which holds the GIL


def available() -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not _triton_available():
        return False
    try:
        from triton.runtime._async_compile import AsyncCompileMode  # noqa: F401
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    return callable(getattr(JITFunction, "run", None))


def forking() -> bool:
    """Whether compiles run in forked children (see the module docstring)."""
    setting = os.environ.get("PEGAINFER_COMPILE_FORK", "1")
    return hasattr(os, "fork") and setting not in ("0", "false", "off")


def default_threads() -> int:
    """``PEGAINFER_COMPILE_THREADS``, or the CPUs this process may use, at most
    ``MAX_FORKED`` when compiles are forked and ``MAX_THREADS`` otherwise."""
    setting = os.environ.get("PEGAINFER_COMPILE_THREADS")
    if setting:
        return max(1, int(setting))
    limit = MAX_FORKED if forking() else MAX_THREADS
    return max(1, min(limit, len(os.sched_getaffinity(0))))


@contextmanager
def compile_ahead(threads: int | None = None) -> Iterator[CompileAheadReport]:
    """Catch every Triton launch in the block and compile its kernel on ``threads`` threads
    instead of running it; on exit every compile is done. Not reentrant, and the launches of
    other threads are caught as well while the block runs."""
    if not available():
        raise RuntimeError("compiling ahead needs Triton with its asynchronous compile mode")
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime._async_compile import AsyncCompileMode, active_mode
    from triton.runtime.jit import JITFunction

    load_triton()
    report = CompileAheadReport(threads=threads or default_threads(), forked=forking())
    original_run = JITFunction.run
    original_do_compile = JITFunction._do_compile

    def caught(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        report.launches += 1
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    filed_kernels: list[tuple[dict, Any, Any]] = []

    def filed(self: Any, key: Any, signature: Any, device: int, *args: Any, **kwargs: Any) -> Any:
        pending = original_do_compile(self, key, signature, device, *args, **kwargs)
        if pending is not None:  # replaced by the compiled kernel when the block ends
            report.found.append((time.monotonic() - started, self.fn.__name__))
            kernel_cache = self.device_caches[device][0]
            kernel_cache[key] = pending
            filed_kernels.append((kernel_cache, key, pending))
        return pending

    if not _active.acquire(blocking=False):
        raise RuntimeError("compile_ahead is already active")
    started = time.monotonic()
    forked_before = compile_child.fork_seconds()
    try:
        with ThreadPoolExecutor(report.threads, thread_name_prefix="triton-compile") as pool:
            mode = AsyncCompileMode(_WithLauncher(pool, report, started))
            JITFunction.run = caught
            JITFunction._do_compile = filed
            try:
                with mode:  # its exit waits for every compile and files each kernel
                    yield report
                    report.run_seconds = time.monotonic() - started
            finally:
                JITFunction.run = original_run
                JITFunction._do_compile = original_do_compile
                _forget_unfinished(filed_kernels)
                # Triton's mode stays active when its exit raises: every later compile in
                # this thread would then go to the closed pool.
                if active_mode.get() is mode:
                    active_mode.set(None)
            report.variants = len(mode.future_kernels)
    finally:
        _active.release()
        report.seconds = time.monotonic() - started
        report.forking = compile_child.fork_seconds() - forked_before


def _forget_unfinished(filed_kernels: list[tuple[dict, Any, Any]]) -> None:
    """Take every compile the block filed and did not finish (it failed, or the block ended
    on another's failure) out of its kernel's cache, so that a later launch compiles afresh
    rather than meeting the pending compile's error."""
    for kernel_cache, key, pending in filed_kernels:
        if kernel_cache.get(key) is pending and getattr(pending, "kernel", None) is None:
            del kernel_cache[key]


class _WithLauncher:
    """An executor for Triton's asynchronous mode whose tasks, once a kernel has compiled,
    build its launcher too (into Triton's cache; the first launch loads it from there)."""

    def __init__(self, pool: Executor, report: CompileAheadReport, started: float) -> None:
        self.pool = pool
        self.report = report
        self.started = started  # the block's entry, on the monotonic clock

    def submit(self, compile_kernel: Callable[[], Any]) -> Future:
        self.report.last_found = time.monotonic() - self.started
        return self.pool.submit(self._timed, compile_kernel)

    def _timed(self, compile_kernel: Callable[[], Any]) -> Any:
        started = time.monotonic()
        kernel = _compile_with_launcher(compile_kernel, self.report.forked)
        self.report.longest = max(self.report.longest, time.monotonic() - started)
        return kernel


def _compile_with_launcher(compile_kernel: Callable[[], Any], forked: bool = False) -> Any:
    if forked:
        compile_child.compiled_in_child(lambda: _build_launcher(compile_kernel()))
    kernel = compile_kernel()  # from the disk cache where the child compiled it
    _build_launcher(kernel)
    return kernel


def _build_launcher(kernel: Any) -> None:
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # the first launch builds it, and reports a real failure
        logger.debug("building a launcher ahead failed", exc_info=True)


def fingerprint(what: str, model: torch.nn.Module, *settings: object) -> str:
    """A key for the kernel variants one stretch of start-up launches: pegainfer's kernel and
    worker sources, the Triton and torch versions, the device, the environment's PEGAINFER_ and
    TRITON_ settings (but the launcher's pid and other plumbing), ``model``'s parameters and buffers (names, shapes, dtypes) and
    ``settings`` (the engine's sizes that pick kernels)."""
    import torch

    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for folder in ("kernels", "worker_proc"):
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".json") and path.is_file():
                digest.update(path.relative_to(root).as_posix().encode())
                digest.update(path.read_bytes())
    tensors = [
        (name, tuple(t.shape), str(t.dtype), str(t.device))
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    environment = sorted(
        (k, v)
        for k, v in os.environ.items()
        if k.startswith(("PEGAINFER_", "TRITON_")) and k not in _NOT_KERNEL_SETTINGS
    )
    digest.update(
        repr(
            (
                what,
                _triton_version(),
                torch.__version__,
                torch.version.cuda,
                torch.cuda.get_device_name(device) if device is not None else None,
                environment,
                tensors,
                settings,
            )
        ).encode()
    )
    return digest.hexdigest()[:32]


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _marker(key: str) -> Path:
    """Where a finished compile-ahead of ``key`` is noted: beside the kernels, in Triton's
    cache, so that emptying that cache forgets it too."""
    try:
        from triton import knobs

        cache_dir = knobs.cache.dir
    except (ImportError, AttributeError):
        cache_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return Path(cache_dir) / "pegainfer-compiled-ahead" / key


def compile_for(
    run: Callable[[], Any], what: str, key: str | None = None
) -> CompileAheadReport | None:
    """Compile ahead what ``run`` launches, and log it; None where ``available()`` is false or
    the caught run failed (its kernels then compile when they are first launched). With a
    ``key`` (``fingerprint``) that an earlier start-up compiled ahead, ``run`` is not run: its
    kernels are then in Triton's disk cache, and the caught pass would only cost time."""
    if os.environ.get("PEGAINFER_COMPILE_AHEAD", "1") in ("0", "false", "off") or not available():
        return None
    marker = _marker(key) if key else None
    if marker is not None and marker.exists():
        logger.info("%s: kernels compiled ahead by an earlier start-up (%s)", what, marker.name)
        return None
    try:
        with compile_ahead() as report:
            run()
    except Exception:
        logger.warning("compiling the %s kernels ahead failed", what, exc_info=True)
        return None
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            logger.warning("could not note the compile-ahead at %s", marker, exc_info=True)
    logger.info(
        "%s: %d Triton kernel variants compiled ahead from %d launches in %.2f s on %d %s "
        "(the caught run %.2f s, its last new variant at %.2f s; the longest compile %.2f s; "
        "forking %.2f s)",
        what,
        report.variants,
        report.launches,
        report.seconds,
        report.threads,
        "forked children" if report.forked else "threads",
        report.run_seconds,
        report.last_found,
        report.longest,
        report.forking,
    )
    if report.found:
        logger.debug(
            "%s: new variants in the order found: %s",
            what,
            ", ".join(f"{name} at {seconds:.2f} s" for seconds, name in report.found),
        )
        logger.info(
            "%s: the last new variants found: %s",
            what,
            ", ".join(f"{name} at {seconds:.2f} s" for seconds, name in report.found[-3:]),
        )
    return report
