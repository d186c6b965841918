"""Start the real `pegainfer` process tree for a test, and check it leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil

from tools.bench_launch import free_port

__all__ = ["READY_TIMEOUT", "Server", "free_port"]

READY_TIMEOUT = 300.0


class Server:
    """One `pegainfer` launcher and its tree, logging to a file."""

    def __init__(self, *args: str, log_path: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        cmd = [sys.executable, "-m", "pegainfer.cli", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.tree_pids: list[int] = []
        self.run_dir: str | None = None

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pegainfer exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        self._record_tree()
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"pegainfer not ready after {timeout} s:\n{self.log()}")

    def _record_tree(self) -> None:
        launcher = psutil.Process(self.proc.pid)
        self.tree_pids = [p.pid for p in launcher.children(recursive=True)]
        match = re.search(r"run dir (\S+)\)", self.log())
        self.run_dir = match.group(1) if match else None

    def children(self) -> dict[str, psutil.Process]:
        """The live children by their process title (pegainfer::NAME)."""
        found = {}
        for pid in self.tree_pids:
            try:
                proc = psutil.Process(pid)
                title = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            found[title.split()[0] if title.startswith("pegainfer::") else title] = proc
        return found

    def log(self) -> str:
        if not self.log_file.closed:
            self.log_file.flush()
        with open(self.log_path) as f:
            return f.read()

    def url(self, path: str) -> str:
        return self.base_url + path

    def post(self, path: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url(path), data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def get(self, path: str, timeout: float = 30) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=timeout) as resp:
                body = resp.read()
                return resp.status, json.loads(body) if body else {}
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log_file.close()
        return code

    def leftovers(self, wait: float = 5.0) -> list[str]:
        """Processes of the tree still alive and the run directory, if it still exists."""
        deadline = time.monotonic() + wait
        while True:
            alive = [pid for pid in self.tree_pids if psutil.pid_exists(pid) and _not_zombie(pid)]
            run_dir_left = self.run_dir is not None and os.path.exists(self.run_dir)
            if (not alive and not run_dir_left) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        left = [f"pid {pid}" for pid in alive]
        if run_dir_left:
            left.append(f"run dir {self.run_dir}")
        return left


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
