"""The Triton linear kernels (kernels/linear.py) against ``F.linear``: the one-row GEMV,
the tensor-core skinny GEMM with and without the split over K, odd sizes, bias, and the
dispatch that sends more than 64 rows to cuBLAS. Fresh random inputs each run (seed in
messages).
"""

from __future__ import annotations

import pytest
import torch
from triton_test_util import (
    CUDA,
    DEVICE,
    check,
    gen,
    gpu_only,
    poisoned,
    randn,
    requires_triton,
)

from kernels.backend import weight_eviction
from kernels.linear import (
    LinearConfig,
    linear,
    linear_ref,
    linear_triton,
    triton_handles,
)
from kernels.linear_configs import MAX_TRITON_ROWS, pick_config

pytestmark = requires_triton

DTYPES = [torch.bfloat16, torch.float16]

# num_stages > 1: the K loop pipelined through shared memory; 1: one tile in flight.
GEMV = [
    LinearConfig("gemv", block_n=4, block_k=64, num_warps=2, num_stages=1),
    LinearConfig("gemv", block_n=1, block_k=128, num_warps=1, num_stages=3),
    LinearConfig("gemv", block_n=2, block_k=32, num_warps=2, num_stages=4),
    LinearConfig("gemv", block_n=2, block_k=64, num_warps=2, block_m=2),
    LinearConfig("gemv", block_n=4, block_k=32, num_warps=4, block_m=8, num_stages=1),
    LinearConfig("gemv", block_n=1, block_k=16, num_warps=1, block_m=4, num_stages=2),
]
SKINNY = [
    LinearConfig("skinny", block_n=32, block_k=32, num_warps=4),
    LinearConfig("skinny", block_n=16, block_k=32, num_warps=4, split_k=3),
    LinearConfig("skinny", block_n=32, block_k=16, num_warps=4, split_k=2, num_stages=2),
]

# (rows, N, K): an N not divisible by the tile, a K not divisible by the chunk, both even.
SHAPES = [(1, 48, 128), (3, 37, 200), (2, 64, 96), (17, 33, 80)]


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, offset: int, bias: bool):
    g = gen(offset)
    x = randn(rows, k, g=g, dtype=dtype)
    weight = randn(n, k, g=g, dtype=dtype, scale=k**-0.5)
    b = randn(n, g=g, dtype=dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    GEMV + SKINNY,
    ids=lambda c: f"{c.kind}-m{c.block_m}-n{c.block_n}-k{c.block_k}-s{c.split_k}-p{c.num_stages}",
)
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(dtype, config, rows, n, k, bias):
    x, weight, b = _inputs(rows, n, k, dtype, 10 + rows + n + k, bias)
    with poisoned():
        out = linear_triton(x, weight, b, config)
    check(
        out,
        linear_ref(x.float(), weight.float(), None if b is None else b.float()).to(dtype),
        f"linear {config} rows={rows} n={n} k={k} bias={bias}",
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_keeps_leading_dims_and_strided_rows(dtype):
    x, weight, _ = _inputs(6, 40, 64, dtype, 3, False)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows with a stride of 128
    out = linear_triton(wide.view(2, 3, 64), weight, None, SKINNY[0])
    assert out.shape == (2, 3, 40)
    check(out.view(6, 40), linear_ref(x.float(), weight.float()).to(dtype), "leading dims")


@pytest.mark.parametrize(
    "config", [GEMV[0], GEMV[3], SKINNY[1], None], ids=["gemv", "rows-gemv", "skinny", "ref"]
)
def test_linear_writes_into_a_given_output(config):
    """``out`` (a slice of a wider buffer, as a decode graph's shared logits) receives the
    same bits the kernel returns without it; a mismatched ``out`` is refused."""
    dtype = torch.bfloat16
    rows = 2 if config is not None and config.block_m == 2 else 3
    x, weight, _ = _inputs(rows, 37, 200, dtype, 77, False)
    buffer = torch.full((8, 37), float("nan"), dtype=dtype, device=DEVICE)
    if config is None:
        expected, written = linear_ref(x, weight), linear_ref(x, weight, out=buffer[:rows])
    else:
        expected = linear_triton(x, weight, None, config)
        written = linear_triton(x, weight, None, config, out=buffer[:rows])
    assert written.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:rows], expected)
    assert torch.isnan(buffer[rows:].float()).all()
    with pytest.raises(ValueError, match="out is"):
        linear(x, weight, out=buffer[: rows + 1])
    with pytest.raises(ValueError, match="out is"):
        linear(x, weight, out=buffer[:rows].float())


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 24, 32, 33, MAX_TRITON_ROWS])
def test_default_config_matches_reference(rows):
    dtype = torch.bfloat16
    n, k = (2560, 4096) if CUDA else (96, 256)
    x, weight, _ = _inputs(rows, n, k, dtype, 40 + rows, False)
    config = pick_config(rows, n, k)
    if config is None:  # cuBLAS: past 32 rows unless a table picks the skinny GEMM
        assert rows > 32
        return
    with poisoned():
        out = linear_triton(x, weight, None, config)
    check(out, linear_ref(x.float(), weight.float()).to(dtype), f"default {config}")


def test_dispatch_rules():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(3, 8, dtype=torch.bfloat16)
    assert not triton_handles(x, w)  # CPU tensors run the reference
    out = linear(x, w)
    assert out.shape == (4, 3)
    if CUDA:
        xg, wg = x[:MAX_TRITON_ROWS].to(DEVICE), w.to(DEVICE)
        assert triton_handles(xg, wg)
        assert triton_handles(torch.zeros(2, 8, dtype=torch.bfloat16, device=DEVICE), wg)
        big = torch.zeros(MAX_TRITON_ROWS + 1, 8, dtype=torch.bfloat16, device=DEVICE)
        assert not triton_handles(big, wg)  # many rows: cuBLAS
        assert not triton_handles(xg.float(), wg.float())  # float32: cuBLAS


def test_two_rows_take_the_gemv_unless_turned_off(monkeypatch):
    monkeypatch.delenv("PEGAINFER_ROWS_GEMV", raising=False)
    assert pick_config(2, 6144, 2560) == LinearConfig("gemv", 4, 512, 2, block_m=2, num_stages=1)
    assert pick_config(2, 2560, 9728) == LinearConfig("gemv", 2, 1024, 4, block_m=2, num_stages=1)
    assert pick_config(2, 151936, 2560).block_m == 2
    assert pick_config(2, 400_000, 2560).block_n == 8  # within the grid's limit
    assert pick_config(3, 2560, 4096).kind == "skinny"
    monkeypatch.setenv("PEGAINFER_ROWS_GEMV", "0")
    assert pick_config(2, 2560, 4096).kind == "skinny"


def test_a_weight_of_few_rows_takes_one_feature_a_program(monkeypatch):
    monkeypatch.delenv("PEGAINFER_LINEAR_TILES", raising=False)
    monkeypatch.delenv("PEGAINFER_GEMV_STAGES", raising=False)
    # A mixture's router (Qwen3-30B-A3B, 235B-A22B): one feature, 1,024 of K, 4 warps.
    assert pick_config(1, 128, 2048) == LinearConfig("gemv", 1, 1024, 4, num_stages=1)
    assert pick_config(1, 128, 4096) == LinearConfig("gemv", 1, 1024, 4, num_stages=1)
    assert pick_config(1, 64, 512) == LinearConfig("gemv", 1, 512, 2, num_stages=1)
    # Qwen3-4B's projections keep the rule's tiles.
    assert pick_config(1, 6144, 2560) == LinearConfig("gemv", 2, 512, 2, num_stages=1)
    assert pick_config(1, 2560, 9728) == LinearConfig("gemv", 2, 1024, 4, num_stages=1)


def test_rows_gemv_needs_whole_vectors_of_k():
    x, weight, _ = _inputs(2, 8, 64, torch.float16, 1, False)
    with pytest.raises(ValueError, match="multiple of 8"):
        linear_triton(x, weight, None, LinearConfig("gemv", 2, 12, 1, block_m=2))


def test_one_row_tiles_can_be_overridden_from_the_environment(monkeypatch):
    from kernels.linear_configs import gemv_tile_overrides

    monkeypatch.setenv("PEGAINFER_LINEAR_TILES", "48,64=8,32,2; 16,64=2,64,4,2")
    assert pick_config(1, 48, 64) == LinearConfig("gemv", 8, 32, 2, num_stages=1)
    assert pick_config(1, 16, 64) == LinearConfig("gemv", 2, 64, 4, num_stages=2)
    # other shapes: the rules (a weight of few rows: one feature a program)
    assert pick_config(1, 48, 128) == LinearConfig("gemv", 1, 512, 2, num_stages=1)
    assert pick_config(1, 19456, 2560) == LinearConfig("gemv", 4, 512, 2, num_stages=1)
    assert pick_config(1, 2560, 4096) == LinearConfig("gemv", 2, 1024, 4, num_stages=1)
    monkeypatch.setenv("PEGAINFER_GEMV_STAGES", "3")
    assert pick_config(1, 2560, 4096) == LinearConfig("gemv", 2, 1024, 4, num_stages=3)
    assert pick_config(1, 48, 64) == LinearConfig("gemv", 8, 32, 2, num_stages=1)  # named
    assert pick_config(2, 48, 64) == LinearConfig("gemv", 4, 512, 2, block_m=2, num_stages=1)
    assert pick_config(3, 48, 64).kind == "skinny"  # other row counts keep their rules
    x, weight, _ = _inputs(1, 48, 64, torch.bfloat16, 5, False)
    with poisoned():
        out = linear_triton(x, weight)  # the overridden tile
    check(out, linear_ref(x.float(), weight.float()).to(torch.bfloat16), "overridden tile")
    with pytest.raises(ValueError, match="PEGAINFER_LINEAR_TILES entry"):
        gemv_tile_overrides("48,64=8,32")


# Qwen3 0.6B, 1.7B, 4B, 8B, 14B, 32B: hidden, intermediate, query heads (head_dim 128, 8 KV
# heads, a 151,936-entry vocabulary).
QWEN3_SHAPES = [
    (1024, 3072, 16),
    (2048, 6144, 16),
    (2560, 9728, 32),
    (4096, 12288, 32),
    (5120, 17408, 40),
    (5120, 25600, 64),
]


@pytest.mark.parametrize("hidden,intermediate,heads", QWEN3_SHAPES)
def test_every_projection_of_qwen3_fits_the_grid_limit(hidden, intermediate, heads, monkeypatch):
    """The GEMV's features run along a grid dimension of at most 65,535 programs: the LM
    head at two rows once made 75,968 at Qwen3-8B's hidden size, and the worker failed at
    start-up."""
    from kernels.backend import cdiv
    from kernels.gemv import MAX_FEATURE_TILES

    monkeypatch.delenv("PEGAINFER_ROWS_GEMV", raising=False)
    monkeypatch.delenv("PEGAINFER_LINEAR_TILES", raising=False)
    projections = {
        "qkv": ((heads + 16) * 128, hidden),
        "o": (hidden, heads * 128),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
        "lm_head": (151_936, hidden),
    }
    for name, (n, k) in projections.items():
        for rows in range(1, MAX_TRITON_ROWS + 1):
            config = pick_config(rows, n, k)
            if config is not None and config.kind == "gemv":
                assert cdiv(n, config.block_n) <= MAX_FEATURE_TILES, (name, rows, config)


@gpu_only
@pytest.mark.parametrize("hidden", [4096, 5120])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_qwen3_lm_heads_at_decode_rows(hidden, rows):
    """Qwen3-8B's and -14B's LM heads (151,936 x 4,096 / 5,120) through the default pick."""
    x, weight, _ = _inputs(rows, 151_936, hidden, torch.bfloat16, 60 + rows, False)
    with poisoned():
        out = linear(x, weight)
    check(out, linear_ref(x.float(), weight.float()).to(torch.bfloat16), f"LM head {rows} rows")


def test_gemv_tiles_stay_within_the_grid_limit():
    from kernels.backend import cdiv
    from kernels.gemv import MAX_FEATURE_TILES

    for vocab in (151_936, 262_144, 1_000_000):
        for k in (1024, 2560, 4096, 8192):
            for rows in (1, 2):
                config = pick_config(rows, vocab, k)
                assert cdiv(vocab, config.block_n) <= MAX_FEATURE_TILES, (vocab, k, rows, config)
    x, _, _ = _inputs(1, 8, 16, torch.bfloat16, 3, False)
    weight = torch.zeros(MAX_FEATURE_TILES + 1, 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="grid's second dimension"):
        linear_triton(x, weight, None, LinearConfig("gemv", 1, 16, 1))


def test_weight_loads_evict_first_unless_turned_off(monkeypatch):
    monkeypatch.delenv("PEGAINFER_EVICT_WEIGHTS", raising=False)
    assert weight_eviction() == "evict_first"
    monkeypatch.setenv("PEGAINFER_EVICT_WEIGHTS", "0")
    assert weight_eviction() == ""
    monkeypatch.setenv("PEGAINFER_EVICT_WEIGHTS", "yes")
    with pytest.raises(ValueError, match="PEGAINFER_EVICT_WEIGHTS"):
        weight_eviction()


@pytest.mark.parametrize(
    "stages,prefetch", [(1, 0), (1, 2), (3, 0)], ids=["registers", "prefetched", "pipelined"]
)
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_skinny_weight_eviction_keeps_the_bits(stages, prefetch, silu_mul, monkeypatch):
    from kernels.linear_fused import linear_silu_and_mul_ref
    from kernels.skinny_gemm import skinny_gemm

    # float16: Triton's interpreter truncates float32 -> bfloat16 where a GPU rounds, and the
    # silu-and-mul epilogue rounds three times.
    rows, n, k = 5, 64, 96
    x, weight, _ = _inputs(rows, 2 * n if silu_mul else n, k, torch.float16, 11, False)
    outputs = []
    for setting in ("0", "1"):
        monkeypatch.setenv("PEGAINFER_EVICT_WEIGHTS", setting)
        with poisoned():
            outputs.append(
                skinny_gemm(
                    x,
                    weight,
                    None,
                    block_n=16,
                    block_k=32,
                    split_k=1 if silu_mul else 2,
                    num_stages=stages,
                    silu_mul=silu_mul,
                    prefetch_tiles=0 if silu_mul else prefetch,
                )
            )
    if silu_mul:
        want = linear_silu_and_mul_ref(x, weight)
    else:
        want = linear_ref(x.float(), weight.float()).to(x.dtype)
    check(outputs[1], want, f"stages={stages} prefetch={prefetch}")
    assert torch.equal(outputs[0], outputs[1])
