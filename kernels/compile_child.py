"""Running one kernel compile in a forked child of the compiling thread
(kernels/compile_ahead.py), with a bound on how long its thread waits for it.

The child only compiles and writes Triton's disk cache, and leaves with ``os._exit``; it
makes no CUDA call. A child that fails, cannot be forked or does not finish in time leaves
the compile to its thread.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# A child compiling one kernel for longer than this is taken to be stuck (a lock another
# thread held at the fork, say) and killed; its thread then compiles in the process. The
# longest compile at start-up takes a few seconds even with every core busy, and the whole
# pass with an empty cache 3.4-3.6 s on an H200 host, so a minute is ample, and a stuck
# child holds the start-up for that minute rather than for many.
CHILD_TIMEOUT_S = 60
# A child still compiling after this long is named in the log (its pid), once.
CHILD_SLOW_S = 10
_fork_lock = threading.Lock()
_fork_seconds = [0.0]  # spent in fork() by this process, all threads together


def fork_seconds() -> float:
    """Seconds this process has spent in ``fork()``, all threads together (it holds the GIL)."""
    return _fork_seconds[0]


def _leave_with_parent() -> None:
    """In a forked child: die with the parent, and leave its SIGTERM handler (the worker's
    would tidy up the whole tree's run directory) for the default."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# Python warns about forking a process with threads. The child here runs only Triton's
# compiler and its subprocesses and writes files: it needs no lock another thread may hold.
warnings.filterwarnings(
    "ignore", message=r".*multi-threaded, use of fork\(\)", category=DeprecationWarning
)


def compiled_in_child(work: Callable[[], Any]) -> bool:
    """Run ``work`` in a forked child and wait for it; True when it returned. The child
    leaves with ``os._exit``: no exit handler, buffered output or CUDA teardown of the
    parent's runs there. False, and nothing run, where the fork fails."""
    try:
        # One fork at a time: fork hooks that other libraries register (filelock's) refuse a
        # fork that starts while another thread's is under way.
        with _fork_lock:
            started = time.monotonic()
            pid = os.fork()
            if pid:
                _fork_seconds[0] += time.monotonic() - started
    except (OSError, RuntimeError):
        logger.debug("fork failed; compiling in the thread", exc_info=True)
        return False
    if pid == 0:  # the child
        status = 1
        try:
            _leave_with_parent()
            work()
            status = 0
        finally:
            os._exit(status)
    began = time.monotonic()
    deadline = began + CHILD_TIMEOUT_S
    slow_at = began + CHILD_SLOW_S
    pause = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        now = time.monotonic()
        if now > slow_at:
            logger.warning(
                "a kernel compile in child %d still runs after %g s (killed at %g s)",
                pid,
                CHILD_SLOW_S,
                CHILD_TIMEOUT_S,
            )
            slow_at = float("inf")
        if now > deadline:  # stuck: its thread compiles instead
            logger.warning(
                "a kernel compile in child %d took over %g s; killed", pid, CHILD_TIMEOUT_S
            )
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
