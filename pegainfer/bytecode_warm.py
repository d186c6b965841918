"""Filling the bytecode cache ahead, in parallel, at the first start that finds it empty.

Where the environment forbids writing bytecode, the processes keep theirs in a cache of
pegainfer's own (pegainfer/bytecode_cache.py). The first start on a machine still compiles
every module it imports from source, one after another in each process: a GPU worker's
imports (torch's, mostly) took 2.9-5.0 s there on an H200 host, against 1.1-2.0 s once
cached. So the launcher runs this module beside the processes at such a start:

    PYTHONPYCACHEPREFIX=CACHE python -m pegainfer.bytecode_warm CACHE PROCESSES

It compiles the source files of the packages a worker imports, torch's first, shallow
modules before deep ones, on ``PROCESSES`` forked processes, skipping files that already
have bytecode there. The importing processes then find most of their bytecode written
before they reach it; a file they reach first they compile themselves, as before, and both
write atomically. Parts of torch a worker never imports (its compiler stack, ONNX export,
test helpers) are left out. Once done it leaves a marker for this interpreter, and later
starts do not run it again (Python still checks each file against its source, so an upgraded
package is recompiled by the process that imports it). It dies with the launcher.
"""

from __future__ import annotations

import importlib.util
import os
import py_compile
import sys
import sysconfig
import time
from collections.abc import Iterable

# In the order a worker needs them, torch first: it is most of the worker's imports.
PACKAGES = (
    "torch",
    "numpy",
    "triton",
    "zmq",
    "msgpack",
    "safetensors",
    "tqdm",
    "typing_extensions",
    "pegainfer",
    "kernels",
    "worker_proc",
    "scheduler_proc",
    "frontend_proc",
    "detokenizer_proc",
)
# Subtrees (package, then path parts) that no process of the tree imports.
SKIPPED = (
    ("torch", "_inductor"),
    ("torch", "_dynamo"),
    ("torch", "onnx"),
    ("torch", "_numpy"),
    ("torch", "_lazy"),
    ("torch", "testing", "_internal"),
)
# Directories left out wherever they are; and the standard library's parts a server never uses.
SKIPPED_NAMES = frozenset({"test", "tests", "__pycache__"})
SKIPPED_STDLIB = frozenset(
    {"idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages"}
    | {"dist-packages", "pydoc_data", "venv"}
)


def marker(directory: str) -> str:
    """The file that says this interpreter's bytecode was filled in ahead."""
    return os.path.join(directory, f".filled-{sys.implementation.cache_tag}")


def package_roots(packages: Iterable[str] = PACKAGES) -> list[tuple[str, str]]:
    """``(name, directory)`` of each package that is installed, without importing any."""
    roots = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for location in (spec.submodule_search_locations or []) if spec else []:
            roots.append((name, location))
    return roots


def source_files(roots: list[tuple[str, str]], stdlib: str | None = None) -> list[str]:
    """The ``.py`` files under ``roots`` (in their order, each shallowest first), then those of
    ``stdlib``, without the skipped subtrees."""
    ordered: list[tuple[int, int, str]] = []
    for rank, (name, root) in enumerate(roots):
        skipped = {os.path.join(root, *parts[1:]) for parts in SKIPPED if parts[0] == name}
        ordered += [(rank, *entry) for entry in _walk(root, skipped, SKIPPED_NAMES)]
    if stdlib is not None:
        top = {os.path.join(stdlib, name) for name in SKIPPED_STDLIB}
        ordered += [(len(roots), *entry) for entry in _walk(stdlib, top, SKIPPED_NAMES)]
    ordered.sort()
    return [path for _, _, path in ordered]


def _walk(root: str, skipped: set[str], skipped_names: frozenset[str]) -> list[tuple[int, str]]:
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [
            d
            for d in subdirectories
            if d not in skipped_names and os.path.join(directory, d) not in skipped
        ]
        depth = os.path.relpath(directory, root).count(os.sep) + (directory != root)
        found += [(depth, os.path.join(directory, f)) for f in files if f.endswith(".py")]
    return found


def compile_one(path: str) -> bool:
    """Compile ``path`` into the cache (``sys.pycache_prefix``) unless it is there already."""
    try:
        target = importlib.util.cache_from_source(path)
        if os.path.exists(target):
            return False
        py_compile.compile(path, cfile=target, doraise=True)
        return True
    except (OSError, SyntaxError, ValueError, py_compile.PyCompileError):
        return False  # the importing process reports what matters


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def fill(
    directory: str,
    processes: int,
    roots: list[tuple[str, str]] | None = None,
    stdlib: str | None = "",
) -> tuple[int, float]:
    """Compile every file of ``source_files`` (of ``roots``, default the installed
    ``PACKAGES``, and of ``stdlib``, default this interpreter's) into ``directory``; returns
    how many were compiled, and the seconds it took."""
    import multiprocessing

    if sys.pycache_prefix is None or os.path.abspath(sys.pycache_prefix) != os.path.abspath(
        directory
    ):
        raise RuntimeError(f"run with PYTHONPYCACHEPREFIX={directory}")
    started = time.monotonic()
    if roots is None:
        roots = package_roots()
    if stdlib == "":
        stdlib = sysconfig.get_paths().get("stdlib")
    files = source_files(roots, stdlib)
    with multiprocessing.get_context("fork").Pool(processes, _die_with_parent) as pool:
        compiled = sum(pool.imap(compile_one, files, chunksize=8))
    seconds = time.monotonic() - started
    with open(marker(directory), "w") as note:
        note.write(f"filled ahead: {compiled} of {len(files)} files compiled in {seconds:.2f} s\n")
    return compiled, seconds


def main(argv: list[str] | None = None) -> int:
    directory, processes = (argv if argv is not None else sys.argv[1:])[:2]
    _die_with_parent()
    fill(directory, max(1, int(processes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
