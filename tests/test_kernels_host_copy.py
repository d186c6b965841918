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


def _tokens_out_case(num_tokens: int, device: str):
    g = torch.Generator().manual_seed(num_tokens)
    tokens = torch.randint(0, 151_936, (num_tokens,), dtype=torch.int64, generator=g)
    slots = torch.randperm(3 * num_tokens + 1, generator=g)[:num_tokens]
    last_token = torch.full((3 * num_tokens + 1,), -5, dtype=torch.int64)
    expected = last_token.clone()
    expected[slots] = tokens
    return tokens.to(device), slots.to(device), last_token.to(device), expected


def test_tokens_out_on_the_cpu_scatters_and_copies():
    tokens, slots, last_token, expected = _tokens_out_case(9, "cpu")
    host = torch.zeros(9, dtype=torch.int64)
    host_copy.tokens_out(host, tokens, last_token, slots)
    assert torch.equal(host, tokens) and torch.equal(last_token, expected)
    with pytest.raises(ValueError, match="one vector's length"):
        host_copy.tokens_out(host, tokens, last_token, slots[:4])


@gpu_only
@pytest.mark.parametrize("num_tokens", [1, 8, 1023, 1025])
@pytest.mark.parametrize("zero_copy", ["1", "0"])
def test_tokens_out_reach_the_host_and_the_slots(num_tokens, zero_copy, monkeypatch):
    """A step's tokens in one launch: to pinned host memory behind an event, and into the
    slots' last tokens, whichever slots and however many; the DMA fallback does the same."""
    host_copy._enabled.cache_clear()
    monkeypatch.setenv("PEGAINFER_ZERO_COPY", zero_copy)
    try:
        tokens, slots, last_token, expected = _tokens_out_case(num_tokens, "cuda")
        host = torch.zeros(num_tokens, dtype=torch.int64, pin_memory=True)
        assert host_copy.kernel_copies(host, tokens) == (zero_copy == "1")
        host_copy.tokens_out(host, tokens, last_token, slots)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        assert torch.equal(host, tokens.cpu())
        assert torch.equal(last_token.cpu(), expected)
    finally:
        host_copy._enabled.cache_clear()
