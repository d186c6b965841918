"""What every child process does first: name itself, log with its name and pid, and make
sure it never outlives the launcher."""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable

import zmq

from pegainfer import ipc, protocol, wire
from pegainfer.config import STAGE_LAUNCHED, EngineConfig
from pegainfer.gc_control import log_collections, settle_heap

PARENT_PID_ENV = "PEGAINFER_PARENT_PID"
_PR_SET_PDEATHSIG = 1

logger = logging.getLogger(__name__)


def setup_logging(name: str, level: str = "info") -> None:
    fmt = f"%(asctime)s %(levelname)s pegainfer::{name}[%(process)d] %(name)s: %(message)s"
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=fmt,
        datefmt="%H:%M:%S",
        stream=sys.stderr,
        force=True,
    )


def set_process_title(name: str) -> None:
    title = f"pegainfer::{name}"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:  # the name in every log line still identifies the process
        pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, title[:15].encode(), 0, 0, 0)  # PR_SET_NAME: the comm shown by top
    except (OSError, AttributeError):
        pass


def _set_parent_death_signal(sig: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def watch_parent(parent_pid: int, run_dir: str | None, interval: float = 0.5) -> None:
    """Exit at once if the launcher is gone.

    The parent-death signal covers most cases; this thread also covers a parent that died
    between fork and prctl, and platforms without prctl. The first child to notice removes
    the run directory, since no launcher is left to do it.
    """

    def loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                if run_dir:
                    shutil.rmtree(run_dir, ignore_errors=True)
                os._exit(1)
            time.sleep(interval)

    threading.Thread(target=loop, name="parent-watch", daemon=True).start()


def init_child(name: str, run_dir: str, stage: int = STAGE_LAUNCHED) -> EngineConfig:
    """Name the process, attach it to its launcher's lifetime, and load the engine config
    once the launcher's start has reached ``stage`` (pegainfer/config.py)."""
    set_process_title(name)
    config = EngineConfig.load(run_dir)
    setup_logging(name, config.log_level)
    # The launcher's watchdog sends SIGUSR2 to every process to see where each one is stuck.
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    ipc.enable_tap(run_dir, name)
    wire.prepare_codecs()
    # Ctrl-C reaches the whole process group; only the launcher acts on it, and it then
    # stops the children in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.environ.get(PARENT_PID_ENV)
    if parent:
        parent_pid = int(parent)
        _set_parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)
        watch_parent(parent_pid, run_dir)
        signal.signal(signal.SIGTERM, lambda *_: _exit_on_sigterm(name, parent_pid, run_dir))
    if config.start_stage < stage:
        config = EngineConfig.wait_for_stage(run_dir, stage)
    return config


_stop_reports: list[Callable[[], None]] = []


def at_stop(report: Callable[[], None]) -> None:
    """Have ``report`` (a last log line of this process's own) run when SIGTERM stops it."""
    _stop_reports.append(report)


def _exit_on_sigterm(name: str, parent_pid: int, run_dir: str) -> None:
    # SIGTERM comes from the launcher stopping the tree, or from the parent-death signal;
    # in the second case no launcher is left to remove the run directory.
    if os.getppid() != parent_pid:
        shutil.rmtree(run_dir, ignore_errors=True)
    log_collections(name)
    for report in _stop_reports:
        try:
            report()
        except Exception:  # a report must never keep the process from stopping
            logging.getLogger(__name__).exception("%s: a stop report failed", name)
    logging.shutdown()
    os._exit(0)


def child_args(description: str, with_rank: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--run-dir", required=True, help="the instance's run directory")
    if with_rank:
        parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--index", type=int, default=0, help="index among processes of a role")
    return parser.parse_args()


def release_free_heap() -> None:
    """Hand the heap that start-up freed back to the OS.

    Loading a tokenizer (or a checkpoint) allocates far more than it keeps: glibc keeps
    the freed pages mapped, scattered between live ones, and they stay resident for the
    life of the process (about 50 MB per process for a 151k-token tokenizer).
    ``malloc_trim`` returns every free page of every arena. Elsewhere than glibc it is a
    no-op. No ``gc.collect`` first: what start-up drops is freed by reference counting, and
    a collection costs the worker 0.1 s on the path to ready."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def report_ready(ctx: zmq.Context, run_dir: str, name: str, *, settle: bool = True, **info) -> None:
    """Tell the launcher this process has started, once start-up's objects are out of the
    garbage collector's walks (pegainfer/gc_control.py) and its garbage is returned to the
    OS. Done after the message, the collection, the trim and a 50 ms wait for the message to
    leave could hold up the first request (queued 30 ms in the scheduler in one CPU run).
    ``settle=False``: the caller settled its heap already (``settle_heap``)."""
    if settle:
        settle_heap(name)
    release_free_heap()
    logger.info("ready %s", " ".join(f"{k}={v}" for k, v in info.items()))
    sock = ipc.connect(ctx, zmq.PUSH, run_dir, "launcher")
    ipc.send(sock, protocol.ProcessReady(name=name, pid=os.getpid(), info=info))
    # LINGER is 0 on our sockets. Closed with one, the socket's message is still delivered
    # by the context's I/O thread after close returns (the context lives on).
    sock.close(linger=1000)
