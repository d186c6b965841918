"""Keeping Python's cyclic garbage collector off the serving path.

A full (generation-2) collection walks every tracked object of the process, and most of
them are start-up's: torch's and Triton's modules, the model, the tokenizer, the block pool.
None of that is ever garbage, yet each full collection scans it again, stopping the process
meanwhile: about 0.1 s in a GPU worker, long enough to leave the GPU idle for dozens of
decode steps. Every process therefore collects once as it becomes ready (just before it
says so, pegainfer/process.py) and moves what survives into the permanent generation (``gc.freeze``); later collections walk only what
serving allocated since. Reference counting still frees frozen objects; only cycles among
them are never reclaimed, and start-up's cycles were collected just before.

The worker, whose start-up is what the launch waits for, goes further: it imports torch with
the collector off (worker_proc/__main__.py), about 270,000 objects that would otherwise be
walked by several full collections on the way, and freezes them as they are
(``freeze_imports``), cyclic garbage included (7,000 objects, about 1 MB), before the
collector comes back on for the rest of its start-up.

``CollectionWatch`` times every collection after that, and logs any longer than
``PEGAINFER_GC_WARN_MS`` (default 20) with its generation and what it found, so that a
pause in a process's timeline has a name; a process that stops logs its totals.
``PEGAINFER_GC_FREEZE=0`` leaves the heap unfrozen (the watch stays).
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

GC_WARN_ENV = "PEGAINFER_GC_WARN_MS"
GC_FREEZE_ENV = "PEGAINFER_GC_FREEZE"
DEFAULT_WARN_MS = 20.0


@dataclass
class HeapFreeze:
    frozen_objects: int
    collected: int
    collect_seconds: float


def freeze_startup_heap() -> HeapFreeze:
    """Collect start-up's cyclic garbage, then exempt every surviving object from later
    collections."""
    began = time.perf_counter()
    collected = gc.collect()
    seconds = time.perf_counter() - began
    gc.freeze()
    return HeapFreeze(gc.get_freeze_count(), collected, seconds)


def warn_threshold_s() -> float:
    raw = os.environ.get(GC_WARN_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_WARN_MS
    except ValueError:
        logger.warning("%s=%r is not a number; using %.0f ms", GC_WARN_ENV, raw, DEFAULT_WARN_MS)
        value = DEFAULT_WARN_MS
    return max(0.0, value) / 1e3


@dataclass(eq=False)
class CollectionWatch:
    """A ``gc.callbacks`` hook: counts collections and their time per generation, and logs
    the slow ones."""

    warn_s: float = field(default_factory=warn_threshold_s)
    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    slow: int = 0
    longest_s: float = 0.0
    _started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        elapsed = time.perf_counter() - self._started
        self._started = None
        generation = min(max(int(info.get("generation", 0)), 0), 2)
        self.counts[generation] += 1
        self.seconds[generation] += elapsed
        self.longest_s = max(self.longest_s, elapsed)
        if elapsed >= self.warn_s:
            self.slow += 1
            logger.warning(
                "a generation-%d garbage collection paused this process %.1f ms "
                "(%d objects collected, %d uncollectable, %d frozen and not walked)",
                generation,
                elapsed * 1e3,
                info.get("collected", 0),
                info.get("uncollectable", 0),
                gc.get_freeze_count(),
            )

    def install(self) -> CollectionWatch:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def summary(self) -> str:
        parts = ", ".join(
            f"generation {generation} {count} ({seconds * 1e3:.1f} ms)"
            for generation, (count, seconds) in enumerate(zip(self.counts, self.seconds))
        )
        return f"{parts}; the longest {self.longest_s * 1e3:.1f} ms, {self.slow} slow"


_watch: CollectionWatch | None = None
_startup_watch: CollectionWatch | None = None


def freeze_imports() -> None:
    """For a process that imported its modules with the collector off: freeze what they
    built and turn the collector back on. Nothing happens where the collector is on."""
    global _startup_watch
    if gc.isenabled():
        return
    if os.environ.get(GC_FREEZE_ENV, "1") != "0":
        gc.freeze()
    _startup_watch = CollectionWatch(warn_s=float("inf")).install()
    gc.enable()


def settle_heap(name: str) -> HeapFreeze | None:
    """What a process does once it is ready: freeze start-up's heap, log it, and watch the
    collections that follow."""
    global _watch, _startup_watch
    if _startup_watch is not None:
        _startup_watch.remove()
        logger.info(
            "%s: garbage collections during start-up, after its imports: %s",
            name,
            _startup_watch.summary(),
        )
        _startup_watch = None
    freeze = None
    if os.environ.get(GC_FREEZE_ENV, "1") == "0":
        logger.info("%s: start-up heap left unfrozen (%s=0)", name, GC_FREEZE_ENV)
    else:
        freeze = freeze_startup_heap()
        logger.info(
            "%s: froze %d objects of start-up in the permanent GC generation "
            "(a full collection took %.1f ms and freed %d)",
            name,
            freeze.frozen_objects,
            freeze.collect_seconds * 1e3,
            freeze.collected,
        )
    if _watch is None:
        _watch = CollectionWatch().install()
    return freeze


def log_collections(name: str) -> None:
    """The collections since ``settle_heap``, for a process that is stopping."""
    if _watch is not None:
        logger.info("%s: garbage collections since ready: %s", name, _watch.summary())
