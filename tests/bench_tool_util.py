"""What the benchmark tools' CPU smoke tests share, beside ``tests/conftest.py``'s
``micro_dir``: a CPU server's arguments, running a tool as its one command, and the checks
on what every tool writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU_SERVER = ["--device", "cpu", "--max-model-len", "128", "--kv-cache-memory", "16MiB"]
# One OMP thread per model: on a small, busy machine two threads per process thrash, and a
# micro model's step goes from a few ms to tens.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run(module: str, *args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", f"tools.{module}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **CPU_ENV, **(env or {})},
    )


def run_tool(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    proc = _run(module, *args, env=env)
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, proc.stderr


def refused(module: str, *args: str) -> str:
    """The error output of a tool run that must fail."""
    proc = _run(module, *args)
    assert proc.returncode != 0, f"{module} ran:\n{proc.stdout[-3000:]}"
    return proc.stderr


def outputs(out_dir, name: str) -> dict:
    png = out_dir / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    return json.loads((out_dir / f"{name}.json").read_text())


def assert_roofline_table(stdout: str, payload: dict) -> None:
    header = [line for line in stdout.splitlines() if "roofline" in line and "  " in line]
    assert header, stdout
    assert payload["table"] and "roofline" in payload["table"]
