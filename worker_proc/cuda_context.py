"""Creating the GPU's CUDA context while the worker imports torch.

Importing torch takes seconds, and creating the CUDA context takes some 0.3 s more once it
is imported. The driver's primary context, which the CUDA runtime (and so torch) adopts for
the device, can be created through the driver API alone, from a thread, while the import
runs; torch then finds it ready. Any failure (no driver, no such device) leaves the work to
torch, which reports it properly.
"""

from __future__ import annotations

import ctypes
import threading


def device_ordinal(device: str, local_rank: int) -> int | None:
    """The CUDA device ordinal the worker will use for ``--device`` (as
    ``worker_proc.model_runner.resolve_device`` picks it), or None for the CPU."""
    if device in ("auto", "cuda"):
        return local_rank
    if device.startswith("cuda:"):
        try:
            return int(device.split(":", 1)[1]) + local_rank
        except ValueError:
            return None
    return None


def start_primary_context(ordinal: int | None) -> threading.Thread | None:
    """Begin creating ``ordinal``'s primary context in a daemon thread; join it before
    torch's first CUDA call to count its time there."""
    if ordinal is None:
        return None
    thread = threading.Thread(
        target=_retain_primary_context, args=(ordinal,), name="cuda-context", daemon=True
    )
    thread.start()
    return thread


def _retain_primary_context(ordinal: int) -> bool:
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # ctypes calls release the GIL
    except OSError:
        return False
    if driver.cuInit(0) != 0:
        return False
    device = ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return False
    context = ctypes.c_void_p()
    # The reference is kept for the process's life, as the runtime keeps its own.
    return driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
