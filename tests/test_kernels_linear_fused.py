"""The fused one-row projections (kernels/linear_fused.py) against their references: the
gate/up GEMV ending in silu-and-mul, and the o/down GEMV ending in the residual add and
RMSNorm through an arrival counter. Fresh random inputs each run (seed in messages).
"""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, check, gen, poisoned, randn, requires_triton

from kernels.linear_fused import (
    fusion_enabled,
    linear_add_rms_norm,
    linear_add_rms_norm_ref,
    linear_add_rms_norm_triton,
    linear_silu_and_mul,
    linear_silu_and_mul_ref,
    linear_silu_and_mul_triton,
)

pytestmark = requires_triton

DTYPES = [torch.bfloat16, torch.float16]
# (output features, K): odd sizes that leave the last tile part empty, and K not a
# multiple of the chunk; the real Qwen3-4B shapes on a GPU.
SHAPES = [(37, 200), (64, 96), (5, 64)] + ([(2560, 4096), (2560, 9728)] if CUDA else [])
# One-row GEMV tiles forced through PEGAINFER_LINEAR_TILES: several K chunks a program.
SMALL_TILES = "74,200=4,64,2;37,200=4,64,2;128,96=2,32,1;64,96=8,32,2"


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` cut to bfloat16's 8 bits of mantissa (toward zero), kept in float32."""
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _row(k: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    return randn(1, k, g=gen(offset), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("tiles", ["rules", "small"])
def test_linear_silu_and_mul_matches_reference(monkeypatch, dtype, n, k, tiles):
    if tiles == "small":
        monkeypatch.setenv("PEGAINFER_LINEAR_TILES", SMALL_TILES)
    x = _row(k, dtype, n + k)
    weight = randn(2 * n, k, g=gen(n + k + 1), dtype=dtype, scale=k**-0.5)
    with poisoned():
        out = linear_silu_and_mul_triton(x, weight)
    # The projection is rounded to the dtype before the epilogue, as the reference does.
    if CUDA or dtype != torch.bfloat16:
        want = linear_silu_and_mul_ref(x, weight)
    else:
        # Triton's CPU interpreter truncates float32 -> bfloat16 where a GPU rounds; with
        # three such casts in a row the error adds up, so the reference truncates too.
        gate, up = _truncated(x.float() @ weight.float().T).chunk(2, dim=-1)
        want = _truncated(torch.nn.functional.silu(gate) * up).to(dtype)
    check(out, want, f"gate_up + silu_and_mul n={n} k={k} tiles={tiles}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("tiles", ["rules", "small"])
def test_linear_add_rms_norm_matches_reference(monkeypatch, dtype, n, k, tiles):
    if tiles == "small":
        monkeypatch.setenv("PEGAINFER_LINEAR_TILES", SMALL_TILES)
    weight = randn(n, k, g=gen(n + k + 2), dtype=dtype, scale=k**-0.5)
    norm_weight = 1.0 + 0.1 * randn(n, g=gen(n + k + 3), dtype=dtype)
    # Twice in a row: the last program must leave the arrival counter at zero.
    for call in range(2):
        x = _row(k, dtype, n + k + 10 * call)
        residual = randn(1, n, g=gen(n + k + 10 * call + 5), dtype=dtype)
        with poisoned():
            normed, new_residual = linear_add_rms_norm_triton(
                x, weight, residual, norm_weight, 1e-6
            )
        want_normed, want_residual = linear_add_rms_norm_ref(x, weight, residual, norm_weight, 1e-6)
        what = f"o/down + add + rmsnorm n={n} k={k} tiles={tiles} call={call}"
        check(new_residual, want_residual, what + " residual")
        check(normed, want_normed, what + " normed")


def test_fused_ops_rescale_with_the_row_not_a_constant():
    """A stub returning the inputs, or the unnormed sum, fails here: the norm of the output
    is about sqrt(hidden) whatever the input's scale, and gate 0 gives 0."""
    dtype = torch.float16
    n, k = 37, 200
    weight = randn(n, k, g=gen(7), dtype=dtype, scale=k**-0.5)
    norm_weight = torch.ones(n, dtype=dtype, device=DEVICE)
    residual = torch.zeros(1, n, dtype=dtype, device=DEVICE)
    for scale in (0.01, 100.0):
        x = _row(k, dtype, 8) * scale
        normed, summed = linear_add_rms_norm_triton(x, weight, residual, norm_weight, 1e-6)
        assert abs(normed.float().norm().item() - n**0.5) < 0.05 * n**0.5
        assert summed.float().abs().max().item() > 0
    gate_up = torch.cat([torch.zeros(n, k), torch.ones(n, k)]).to(dtype).to(DEVICE)
    assert torch.count_nonzero(linear_silu_and_mul_triton(_row(k, dtype, 9), gate_up)) == 0


def test_dispatch_fuses_only_one_cuda_row(monkeypatch):
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    w = torch.zeros(6, 8, dtype=torch.bfloat16)
    assert not fusion_enabled(x, w)  # CPU tensors run the two references
    residual = torch.ones(3, 6, dtype=torch.bfloat16)
    normed, summed = linear_add_rms_norm(
        torch.ones(3, 8, dtype=torch.bfloat16),
        w,
        residual,
        torch.ones(6, dtype=torch.bfloat16),
        1e-6,
    )
    assert torch.equal(summed, residual) and torch.allclose(normed.float(), torch.ones(3, 6))
    assert linear_silu_and_mul(torch.ones(3, 8, dtype=torch.bfloat16), w).shape == (3, 3)
    if CUDA:
        xg, wg = x.to(DEVICE), w.to(DEVICE)
        assert fusion_enabled(xg, wg)
        assert not fusion_enabled(torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE), wg)
        monkeypatch.setenv("PEGAINFER_FUSED_GEMV", "0")
        assert not fusion_enabled(xg, wg)
