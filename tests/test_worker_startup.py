"""The worker's start-up overlaps: the CUDA context made while torch imports, and Triton
warmed while the weights load."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from worker_proc.cuda_context import (
    _retain_primary_context,
    device_ordinal,
    register_host_memory,
    start_primary_context,
    unregister_host_memory,
)


@pytest.mark.parametrize(
    "device,rank,ordinal",
    [("cpu", 0, None), ("auto", 1, 1), ("cuda", 2, 2), ("cuda:3", 1, 4), ("cuda:x", 0, None)],
)
def test_device_ordinal_matches_the_runner(device, rank, ordinal):
    assert device_ordinal(device, rank) == ordinal


def test_no_thread_for_the_cpu():
    assert start_primary_context(None) is None


def test_primary_context_is_made_where_there_is_a_gpu():
    thread = start_primary_context(0)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _retain_primary_context(0) is torch.cuda.is_available()
    # An ordinal past the last GPU fails quietly, leaving the error to torch.
    assert _retain_primary_context(10_000) is False


@pytest.mark.parametrize("disabled", [False, True])
def test_triton_warm_up_binds_the_kernels(disabled):
    """In a fresh interpreter: the warm-up imports Triton and binds every kernel (launchable
    as ``kernel[grid]``, compiled or interpreted), unless Triton is switched off; either way
    it returns."""
    code = (
        "import sys, kernels.backend as b, kernels.rmsnorm as r; b.warm_up_triton(); "
        "print(int('triton' in sys.modules), int(b._triton is not None), "
        "int(hasattr(r._rms_norm_kernel, '__getitem__')))"
    )
    env = dict(os.environ, PEGAINFER_DISABLE_TRITON="1" if disabled else "0")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    flags = out.stdout.split()
    try:
        import triton  # noqa: F401
    except ImportError:
        assert flags == ["0", "0", "0"]
        return
    assert flags == (["0", "0", "0"] if disabled else ["1", "1", "1"])


def test_host_memory_is_page_locked_where_there_is_a_gpu():
    """Through the driver: True with a GPU (and the copy from it is a DMA), a plain False
    without one."""
    import mmap

    memory = mmap.mmap(-1, 1 << 20)
    host = torch.frombuffer(memory, dtype=torch.uint8)
    host.fill_(7)
    if not torch.cuda.is_available():
        assert register_host_memory(host.data_ptr(), host.numel()) is False
    else:
        torch.empty(1, device="cuda")  # the context this thread registers with
        assert register_host_memory(host.data_ptr(), host.numel()) is True
        device = torch.empty_like(host, device="cuda")
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        assert int(device.sum()) == 7 * host.numel()
        unregister_host_memory(host.data_ptr())
    del host
    memory.close()


def test_a_failing_triton_warm_up_only_logs(monkeypatch, caplog):
    import kernels.backend as backend

    def broken() -> bool:
        raise RuntimeError("no Triton driver")

    monkeypatch.setattr(backend, "_triton_available", broken)
    with caplog.at_level("WARNING", logger="kernels.backend"):
        backend.warm_up_triton()  # the worker's load goes on; the first launch would report
    assert "Triton warm-up failed" in caplog.text and "no Triton driver" in caplog.text
