"""Start a `pegainfer` process tree for a benchmark, wait for /health, measure the tree's host
memory, and stop it.

The tree is started as ``python -m pegainfer.cli`` from this interpreter, so a benchmark
measures the working tree it runs from, installed or not. HTTP binds 127.0.0.1 only.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out to ``connect`` and to binds of port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _ports_free(base: int, count: int) -> bool:
    try:
        for port in range(base, base + count):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port))
    except OSError:
        return False
    return True


def free_port(count: int = 1) -> int:
    """A base port with ``count`` consecutive ports free on 127.0.0.1, taken below the
    kernel's ephemeral range: a port found free there by binding port 0 can be handed to
    another socket (a tensor-parallel group's connections, say) before the server binds it."""
    low, _ = ephemeral_port_range()
    picker = random.Random()
    for _ in range(200):
        if low > 10_000 + count:
            base = picker.randrange(10_000, low - count)
        else:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                base = probe.getsockname()[1]
        if base + count <= 65_536 and _ports_free(base, count):
            return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


@dataclass
class ProcessMemory:
    name: str
    pid: int
    rss: int
    uss: int | None
    pss: int | None


@dataclass
class TreeMemory:
    processes: list[ProcessMemory] = field(default_factory=list)

    @property
    def rss(self) -> int:
        return sum(p.rss for p in self.processes)

    @property
    def uss(self) -> int | None:
        values = [p.uss for p in self.processes]
        return None if None in values else sum(v for v in values if v is not None)

    @property
    def pss(self) -> int | None:
        values = [p.pss for p in self.processes]
        return None if None in values else sum(v for v in values if v is not None)


def _exit_on_sigterm() -> None:
    """Turn SIGTERM (``timeout``, a job runner) into SystemExit, so that the ``with`` block of
    a ServerProcess stops the tree instead of leaving it running, holding the GPU."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:

        def handler(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, handler)


class ServerProcess:
    """One launcher and its children; a context manager that always stops the tree."""

    def __init__(
        self,
        model_path: str | None,
        extra_args: Sequence[str] = (),
        log_path: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.devnull
        self._log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "pegainfer.cli", "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)]
        if model_path:
            cmd += ["--model-path", model_path]
        cmd += list(extra_args)
        self.command = cmd
        child_env = {**os.environ, **(env or {})}
        # The tools may run from anywhere; the tree imports the packages of this checkout.
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_REPO, child_env.get("PYTHONPATH", "")) if p
        )
        _exit_on_sigterm()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env
        )

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wait_ready(self, timeout: float = 600.0, poll_s: float = 0.05) -> float:
        """Seconds from launch until /health answers 200."""
        deadline = self.started + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"pegainfer exited with {self.proc.returncode} before it was ready:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - self.started
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(poll_s)
        self.stop()
        raise TimeoutError(f"pegainfer not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def tree(self) -> list[psutil.Process]:
        try:
            launcher = psutil.Process(self.proc.pid)
            return [launcher, *launcher.children(recursive=True)]
        except psutil.Error:
            return []

    def memory(self) -> TreeMemory:
        """Resident memory of every process of the tree (USS and PSS where the OS has them)."""
        found = TreeMemory()
        for proc in self.tree():
            try:
                cmdline = proc.cmdline()
                name = (
                    cmdline[0] if cmdline and cmdline[0].startswith("pegainfer::") else "launcher"
                )
                if name == "launcher" and proc.pid != self.proc.pid:
                    name = " ".join(cmdline[:3])
                try:
                    full = proc.memory_full_info()
                    rss, uss, pss = full.rss, getattr(full, "uss", None), getattr(full, "pss", None)
                except (psutil.AccessDenied, AttributeError):
                    rss, uss, pss = proc.memory_info().rss, None, None
            except psutil.Error:
                continue
            found.processes.append(ProcessMemory(name, proc.pid, rss, uss, pss))
        return found

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path == os.devnull:
            return "(no log kept)"
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # The launcher failed to stop its tree: end what it started, one by one.
                for proc in reversed(self.tree()):
                    try:
                        proc.kill()
                    except psutil.Error:
                        pass
                self.proc.wait()
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode
