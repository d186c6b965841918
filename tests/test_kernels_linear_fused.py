"""The gate/up GEMV ending in silu-and-mul (kernels/linear_fused.py), of one row and of
several, against its reference, and its dispatch. Fresh random inputs each run (seed in messages).
"""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, check, gen, poisoned, randn, requires_triton

from kernels.linear import LinearConfig, linear_add_residual_triton
from kernels.linear_fused import (
    fusion_enabled,
    linear_silu_and_mul,
    linear_silu_and_mul_ref,
    linear_silu_and_mul_triton,
)
from kernels.linear_fused_rows import linear_silu_and_mul_rows, rows_fusion_config
from kernels.pending_norm import PendingNorm

pytestmark = requires_triton

DTYPES = [torch.bfloat16, torch.float16]
# (output features, K): odd sizes that leave the last tile part empty, and K not a
# multiple of the chunk; the real Qwen3-4B shapes on a GPU.
SHAPES = [(37, 200), (64, 96), (5, 64)] + ([(2560, 4096), (2560, 9728)] if CUDA else [])
# One-row GEMV tiles forced through PEGAINFER_LINEAR_TILES: several K chunks a program.
SMALL_TILES = "74,200=4,64,2;128,96=2,32,1;10,64=8,32,2"


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` cut to bfloat16's 8 bits of mantissa (toward zero), kept in float32."""
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _row(k: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    return randn(1, k, g=gen(offset), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("tiles", ["rules", "small"])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_linear_silu_and_mul_matches_reference(monkeypatch, dtype, n, k, tiles, prefetch):
    if tiles == "small":
        monkeypatch.setenv("PEGAINFER_LINEAR_TILES", SMALL_TILES)
    x = _row(k, dtype, n + k)
    weight = randn(2 * n, k, g=gen(n + k + 1), dtype=dtype, scale=k**-0.5)
    with poisoned():
        out = linear_silu_and_mul_triton(x, weight, prefetch_tiles=prefetch)
    # The projection is rounded to the dtype before the epilogue, as the reference does.
    if CUDA or dtype != torch.bfloat16:
        want = linear_silu_and_mul_ref(x, weight)
    else:
        # Triton's CPU interpreter truncates float32 -> bfloat16 where a GPU rounds; with
        # three such casts in a row the error adds up, so the reference truncates too.
        gate, up = _truncated(x.float() @ weight.float().T).chunk(2, dim=-1)
        want = _truncated(torch.nn.functional.silu(gate) * up).to(dtype)
    check(out, want, f"gate_up + silu_and_mul n={n} k={k} tiles={tiles} prefetch={prefetch}")


def test_fused_gate_up_gates_each_feature_by_its_own_gate():
    """Gate rows of zero give zeros whatever ``up`` is; a gate of ``g`` on every feature
    gives ``silu(g) * up`` feature by feature, so a swapped or shifted half shows."""
    dtype = torch.float16
    n, k = 37, 200
    x = torch.ones(1, k, dtype=dtype, device=DEVICE) / k
    up = torch.arange(n, dtype=torch.float32)[:, None].expand(n, k)
    gate_up = torch.cat([torch.zeros(n, k), up]).to(dtype).to(DEVICE)
    assert torch.count_nonzero(linear_silu_and_mul_triton(x, gate_up)) == 0
    gate_up = torch.cat([torch.full((n, k), 2.0), up]).to(dtype).to(DEVICE)
    want = torch.nn.functional.silu(torch.tensor(2.0)) * torch.arange(n, dtype=torch.float32)
    got = linear_silu_and_mul_triton(x, gate_up).float().cpu()[0]
    torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-3)


def test_dispatch_fuses_only_one_cuda_row(monkeypatch):
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    w = torch.zeros(6, 8, dtype=torch.bfloat16)
    assert not fusion_enabled(x, w)  # CPU tensors run the two references
    rows = torch.randn(3, 8).to(torch.bfloat16)
    w = torch.randn(6, 8).to(torch.bfloat16)
    assert torch.equal(linear_silu_and_mul(rows, w), linear_silu_and_mul_ref(rows, w))
    if CUDA:
        xg, wg = x.to(DEVICE), w.to(DEVICE)
        assert fusion_enabled(xg, wg)
        assert not fusion_enabled(torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE), wg)
        monkeypatch.setenv("PEGAINFER_FUSED_GEMV", "0")
        assert not fusion_enabled(xg, wg)


# (rows, tile): two rows in a tile of two, three in a tile of four; tiles of several K steps.
ROW_TILES = [
    (2, LinearConfig("gemv", 2, 32, 1, block_m=2, num_stages=1)),
    (3, LinearConfig("gemv", 1, 64, 2, block_m=4, num_stages=2)),
]


def _truncated_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference, or on CPU in bfloat16 the interpreter's truncating casts (see above)."""
    if CUDA or x.dtype != torch.bfloat16:
        return linear_silu_and_mul_ref(x, weight)
    gate, up = _truncated(x.float() @ weight.float().T).chunk(2, dim=-1)
    return _truncated(torch.nn.functional.silu(gate) * up).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows,config", ROW_TILES)
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_rows_silu_and_mul_matches_reference(dtype, n, k, rows, config, prefetch):
    g = gen(n + k + rows)
    x = randn(rows, k, g=g, dtype=dtype)
    weight = randn(2 * n, k, g=g, dtype=dtype, scale=k**-0.5)
    with poisoned():
        out = linear_silu_and_mul_rows(x, weight, config, prefetch_tiles=prefetch)
    label = f"{rows} rows n={n} k={k} {config} prefetch={prefetch}"
    check(out, _truncated_reference(x, weight), label)


def test_rows_silu_and_mul_applies_a_pending_norm():
    dtype = torch.float16
    rows, hidden, n = 2, 48, 24
    g = gen(31)
    x = randn(rows, 40, g=g, dtype=dtype)
    o_weight = randn(hidden, 40, g=g, dtype=dtype, scale=40**-0.5)
    residual = randn(rows, hidden, g=g, dtype=dtype)
    norm_weight = (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    producer = LinearConfig("gemv", 4, 32, 1, block_m=2, num_stages=1)
    stream, sums, weighted = linear_add_residual_triton(
        x, o_weight, residual, norm_weight, producer
    )
    pending = PendingNorm(stream, norm_weight, 1e-6, sums, weighted)
    gate_up = randn(2 * n, hidden, g=g, dtype=dtype, scale=hidden**-0.5)
    with poisoned():
        out = linear_silu_and_mul_rows(pending, gate_up, ROW_TILES[0][1])
    check(out, linear_silu_and_mul_ref(pending.materialize(), gate_up), "pending norm")


def test_rows_fusion_takes_two_cuda_rows(monkeypatch):
    monkeypatch.delenv("PEGAINFER_ROWS_GEMV", raising=False)
    weight = torch.zeros(2 * 9728, 2560, dtype=torch.bfloat16)
    assert rows_fusion_config(torch.zeros(2, 2560, dtype=torch.bfloat16), weight) is None  # CPU
    if not CUDA:
        return
    weight = weight.to(DEVICE)
    two = torch.zeros(2, 2560, dtype=torch.bfloat16, device=DEVICE)
    assert rows_fusion_config(two, weight) == LinearConfig("gemv", 2, 512, 2, 2, num_stages=1)
    assert rows_fusion_config(two[:1], weight) is None
    assert (
        rows_fusion_config(torch.zeros(3, 2560, dtype=torch.bfloat16, device=DEVICE), weight)
        is None
    )
    monkeypatch.setenv("PEGAINFER_ROWS_GEMV", "linear")
    assert rows_fusion_config(two, weight) is None
    monkeypatch.setenv("PEGAINFER_ROWS_GEMV", "sometimes")
    with pytest.raises(ValueError, match="PEGAINFER_ROWS_GEMV"):
        rows_fusion_config(two, weight)
