"""A bytecode cache for the children when the environment forbids writing bytecode.

Container images often set ``PYTHONDONTWRITEBYTECODE=1`` to keep ``.pyc`` files out of the
image. Where the installed packages ship no bytecode either, Python then compiles every
module it imports from source at every start. A GPU worker imports about a thousand (torch's,
mostly): on an H200 host, 2.4 s of a worker's start went to ``compile()`` (cProfile of
``bench_latency``'s start-up), and importing the worker's modules took 2.5-2.7 s against 1.0 s
once their bytecode was cached on a 2-core machine.

So when ``PYTHONDONTWRITEBYTECODE`` is set, the launcher starts its children with
``PYTHONPYCACHEPREFIX`` pointing at ``bytecode/`` in pegainfer's cache directory
(``$PEGAINFER_CACHE``, else ``~/.cache/pegainfer``) and without ``PYTHONDONTWRITEBYTECODE``:
the first start writes each module's bytecode there, later starts read it, and the source
trees stay free of ``.pyc`` files, which is what the setting is for. Python checks each file
against its source, so an upgraded package is recompiled once. A ``PYTHONPYCACHEPREFIX``
already set is kept as it is, and ``PEGAINFER_BYTECODE_CACHE=0`` leaves the environment alone.
At the first start, which finds the cache unfilled, ``start_filling`` compiles the workers'
imports into it in parallel beside the processes (pegainfer/bytecode_warm.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

from pegainfer.default_model import default_cache_dir

BYTECODE_CACHE_ENV = "PEGAINFER_BYTECODE_CACHE"


def bytecode_cache_for_children(env: dict[str, str]) -> str | None:
    """Give ``env`` (the children's environment, changed in place) a bytecode cache where it
    forbids writing bytecode; returns the cache's directory, or None where nothing changed."""
    if env.get(BYTECODE_CACHE_ENV, "1").lower() in ("0", "false", "off"):
        return None
    if not env.get("PYTHONDONTWRITEBYTECODE") or env.get("PYTHONPYCACHEPREFIX"):
        return None
    directory = os.path.join(default_cache_dir(), "bytecode")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError:
        return None
    if not os.access(directory, os.W_OK | os.X_OK):
        return None
    env["PYTHONPYCACHEPREFIX"] = directory
    del env["PYTHONDONTWRITEBYTECODE"]
    return directory


# Processes that fill the cache ahead: at most this many, and only where they leave this many
# CPUs to the tree's own processes, which import at the same time.
FILL_PROCESSES = 8
CPUS_KEPT = 4
FILL_ENV = "PEGAINFER_BYTECODE_FILL"


def start_filling(
    directory: str, env: dict[str, str], cpus: int | None = None
) -> tuple[subprocess.Popen, int] | None:
    """At a first start (``directory`` not yet filled for this interpreter), start filling it
    on a process of its own (pegainfer/bytecode_warm.py); returns it and the processes it
    compiles on, or None where it is filled already or the CPUs are too few to spare.
    ``PEGAINFER_BYTECODE_FILL`` sets the processes (0: none)."""
    from pegainfer.bytecode_warm import marker

    if os.path.exists(marker(directory)):
        return None
    setting = env.get(FILL_ENV, "")
    if setting:
        processes = int(setting)  # 0: no filling ahead
    else:
        if cpus is None:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        processes = min(FILL_PROCESSES, cpus - CPUS_KEPT)
        if processes < 2:  # one process beside the tree's would hardly run ahead of them
            return None
    if processes < 1:
        return None
    command = [sys.executable, "-m", "pegainfer.bytecode_warm", directory, str(processes)]
    try:
        filler = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
    except OSError:
        return None
    return filler, processes


def filled_note(directory: str) -> str:
    """What the filler of ``directory`` left in its marker (how many files, how long)."""
    from pegainfer.bytecode_warm import marker

    try:
        with open(marker(directory)) as note:
            return note.read().strip()
    except OSError:
        return "not filled"
