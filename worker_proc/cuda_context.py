"""The CUDA driver API, through ctypes, for what the worker does before or beside torch.

- The primary context, created while torch imports. Importing torch takes seconds, and
  creating the CUDA context some 0.3 s more once it is imported. The driver's primary
  context, which the CUDA runtime (and so torch) adopts for the device, can be created
  through the driver API alone, from a thread, while the import runs; torch then finds it
  ready. Any failure (no driver, no such device) leaves the work to torch, which reports
  it properly.
- Page-locking host memory the weight loader allocated itself. Through the driver API a
  refusal is only a return code, where the runtime's would also linger as the thread's
  last error, for torch's next launch check to raise.
"""

from __future__ import annotations

import ctypes
import functools
import threading


def device_ordinal(device: str, local_rank: int) -> int | None:
    """The CUDA device ordinal the worker will use for ``--device`` (as
    ``worker_proc.device_choice.resolve_device`` picks it), or None for the CPU."""
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


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")  # ctypes calls release the GIL
        driver.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        driver.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):  # no driver, or one without these entry points
        return None
    return driver


def register_host_memory(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``address`` for the context current on this thread; False
    (and nothing else) when the driver refuses."""
    driver = _driver()
    if driver is None:
        return False
    return driver.cuMemHostRegister_v2(address, nbytes, 0) == 0


def unregister_host_memory(address: int) -> None:
    driver = _driver()
    if driver is not None:
        driver.cuMemHostUnregister(address)


def _retain_primary_context(ordinal: int) -> bool:
    driver = _driver()
    if driver is None:
        return False
    if driver.cuInit(0) != 0:
        return False
    device = ctypes.c_int()
    if driver.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        return False
    context = ctypes.c_void_p()
    # The reference is kept for the process's life, as the runtime keeps its own.
    return driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
