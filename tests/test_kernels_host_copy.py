"""Copies between pinned host memory and the device by kernel (kernels/host_copy.py): the
same bytes as the DMA copy, both ways, at sizes around the kernel's block; the fallbacks on
the CPU, for pageable memory and with ``PEGAINFER_ZERO_COPY=0``."""

from __future__ import annotations

import pytest
import torch

from kernels import host_copy

CUDA = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (pinned memory mapped for kernels)")


def test_cpu_tensors_take_the_reference_copy():
    src = torch.arange(10, dtype=torch.int64)
    dst = torch.zeros(10, dtype=torch.int64)
    assert not host_copy.kernel_copies(dst, src)
    host_copy.copy_pinned(dst, src)
    assert torch.equal(dst, src)


@gpu_only
@pytest.mark.parametrize("num_bytes", [4, 16, 4096, 4100, 3 * 4096 + 12, 1 << 16])
def test_pinned_to_device_and_back(num_bytes):
    g = torch.Generator().manual_seed(num_bytes)
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g)
    host = data.pin_memory()
    device = torch.full((num_bytes,), 7, dtype=torch.uint8, device="cuda")
    assert host_copy.kernel_copies(device, host)
    host_copy.copy_pinned(device, host)
    back = torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=True)
    host_copy.copy_pinned(back, device)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), data)
    assert torch.equal(back, data)


@gpu_only
def test_sampled_tokens_reach_the_host_behind_an_event():
    """As the worker reads a step's tokens: int64 on the device, an event behind the copy."""
    tokens = torch.randint(0, 151_936, (37,), dtype=torch.int64, device="cuda")
    host = torch.empty(37, dtype=torch.int64, pin_memory=True)
    host_copy.copy_pinned(host, tokens)
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    assert torch.equal(host, tokens.cpu())


@gpu_only
def test_pageable_memory_unaligned_views_and_the_setting_take_the_dma_copy(monkeypatch):
    device = torch.zeros(64, dtype=torch.uint8, device="cuda")
    assert not host_copy.kernel_copies(device, torch.ones(64, dtype=torch.uint8))
    pinned = torch.ones(64, dtype=torch.uint8, pin_memory=True)
    assert not host_copy.kernel_copies(device[1:], pinned[1:])
    assert not host_copy.kernel_copies(device[:6], pinned[:6])
    host_copy._enabled.cache_clear()
    monkeypatch.setenv("PEGAINFER_ZERO_COPY", "0")
    try:
        assert not host_copy.kernel_copies(device, pinned)
        host_copy.copy_pinned(device, pinned)
        torch.cuda.synchronize()
        assert torch.equal(device.cpu(), pinned)
    finally:
        host_copy._enabled.cache_clear()
