"""Every Triton kernel's dependencies resolve as the compiler will resolve them.

Triton's CPU interpreter runs kernels as plain Python, so a kernel that calls a helper kernel
imported by name from another module (which Triton cannot bind: only module attributes and
its own module's globals are rebound to their compiled functions) passes every CPU test and
fails on a GPU at its first launch. Computing each kernel's cache key walks its references
as compilation does; it needs Triton but no GPU, in a process without the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from triton_test_util import requires_triton

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import importlib, pkgutil, sys
import kernels
from kernels.backend import load_triton
modules = [importlib.import_module(f"kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
load_triton()
checked, failed = 0, []
for module in modules:
    for name, obj in vars(module).items():
        if "JITFunction" in type(obj).__name__ and obj.fn.__module__ == module.__name__:
            checked += 1
            try:
                obj.cache_key
            except Exception as error:
                failed.append(f"{module.__name__}.{name}: {error}")
print(checked)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@requires_triton
def test_every_kernel_resolves_its_dependencies():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert int(result.stdout.split()[0]) > 50  # every kernel module was seen
