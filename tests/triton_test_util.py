"""Shared by the Triton kernel tests: interpreter setup, seeds, NaN poisoning, tolerances.

Importing this module first sets TRITON_INTERPRET=1 when there is no CUDA, before Triton
is imported by anything, so the kernels run in Triton's CPU interpreter at tiny sizes;
with CUDA they run compiled. Outputs the wrappers allocate come back NaN-filled unless a
kernel wrote them (torch's fill_uninitialized_memory, see ``poisoned``), and caches start
as NaN, so an element a kernel forgets to write, or a stale slot it reads, shows up as NaN.

The seed is fresh each run (set PEGAINFER_TEST_SEED to replay one); it is in every
failure message.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
from collections.abc import Iterator

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA (realistic sizes)")

DEVICE = torch.device("cuda" if CUDA else "cpu")
SEED = int(os.environ.get("PEGAINFER_TEST_SEED", 0)) or random.SystemRandom().randrange(1, 2**31)
# Float32 kernels use IEEE products (no tf32), so they match the reference closely. The
# CPU interpreter truncates float32 -> bfloat16 (no rounding): still well inside 1e-2.
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert not actual.isnan().any(), f"{what}: NaN in output (seed {SEED})"
    err = rel_err(actual, expected)
    assert err < TOL[expected.dtype], f"{what}: relative error {err:.2e} (seed {SEED})"


@contextlib.contextmanager
def poisoned() -> Iterator[None]:
    """Every torch.empty inside comes back NaN-filled, so unwritten output shows."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = was_fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def gen(offset: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + offset)


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype, scale: float = 1.0):
    return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)


def distinct_logits(tokens: int, experts: int, offset: int) -> torch.Tensor:
    """Router logits with no two equal in a row, so that the top-k set is unambiguous."""
    g = gen(offset)
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    return (ranks.float() * 0.37 + 0.05 * torch.rand(tokens, experts, generator=g)).to(DEVICE)


def nan_cache(num_blocks, block_size, kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    written = ~expected.isnan()
    assert torch.equal(actual.isnan(), ~written), f"{what}: wrong slots written (seed {SEED})"
    check(actual[written], expected[written], what)
