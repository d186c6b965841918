"""The skinny GEMM for 2-64 rows (kernels/skinny_gemm.py) against its references: plain and
with silu-and-mul fused, split over K (merged by the last program of a tile) or not, odd
sizes, bias, counters left at zero for the next launch; the tables that pick its tiles
(kernels/linear_configs.py). Fresh random inputs each run (seed in messages).
"""

from __future__ import annotations

import json

import pytest
import torch
from triton_test_util import CUDA, DEVICE, check, gen, gpu_only, poisoned, randn, requires_triton

from kernels.attention_merge import split_counters
from kernels.linear import LinearConfig, linear_ref
from kernels.linear_configs import parse_table, skinny_config, skinny_rule
from kernels.linear_fused import linear_silu_and_mul, linear_silu_and_mul_ref
from kernels.skinny_gemm import block_rows, skinny_gemm, skinny_gemm_with

pytestmark = requires_triton

DTYPES = [torch.bfloat16, torch.float16]
# (rows, N, K, block_n, block_k, split_k): an N the tile does not divide, a K the chunk does
# not divide, splits that leave the last one short or hold one chunk, every padded row count.
CASES = [
    (2, 37, 200, 16, 32, 1),
    (5, 40, 96, 16, 32, 3),
    (16, 64, 128, 32, 32, 4),
    (17, 33, 80, 32, 16, 2),
    (32, 48, 64, 16, 16, 2),
    (33, 20, 128, 16, 32, 1),
    (64, 24, 96, 16, 32, 3),
    (8, 40, 64, 16, 32, 2),
]


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, offset: int):
    g = gen(offset)
    return randn(rows, k, g=g, dtype=dtype), randn(n, k, g=g, dtype=dtype, scale=k**-0.5)


def _reference(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, bias=None) -> torch.Tensor:
    if silu_mul:
        # The projection is rounded to the dtype first, as the kernel does.
        return linear_silu_and_mul_ref(x, weight)
    return linear_ref(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` cut to bfloat16's 8 bits of mantissa (toward zero), kept in float32."""
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _counters_clear() -> bool:
    return not torch.count_nonzero(split_counters(1, DEVICE)[:4096]).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "silu_mul,paired",
    [(False, False), (True, False), (True, True)],
    ids=["plain", "silu_mul", "silu_mul_paired"],
)
@pytest.mark.parametrize("rows,n,k,block_n,block_k,split_k", CASES)
def test_skinny_gemm_matches_reference(
    dtype, silu_mul, paired, rows, n, k, block_n, block_k, split_k
):
    x, weight = _operands(rows, 2 * n if silu_mul else n, k, dtype, rows + n + k)
    with poisoned():
        out = skinny_gemm(
            x, weight, None, block_n, block_k, split_k, silu_mul=silu_mul, paired=paired
        )
    want = _reference(x, weight, silu_mul)
    if silu_mul and not CUDA and dtype == torch.bfloat16:
        # Triton's interpreter truncates float32 -> bfloat16 where a GPU rounds; with three
        # such casts in a row the error adds up, so the reference truncates too.
        gate, up = _truncated(x.float() @ weight.float().T).chunk(2, dim=-1)
        want = _truncated(torch.nn.functional.silu(gate) * up).to(dtype)
    what = f"skinny rows={rows} n={n} k={k} tile={block_n}x{block_k} split={split_k} {paired=}"
    check(out, want, what)
    assert _counters_clear(), "a split launch left a tile counter set"


# (rows, N, K, block_n, block_k, split_k, groups): features divided evenly over the programs,
# N / groups not whole, split or not, a K the chunk does not divide, every padded row count.
BALANCED = [
    (3, 37, 96, 16, 32, 1, 3),
    (8, 70, 80, 16, 32, 2, 5),
    (20, 100, 128, 32, 32, 3, 4),
    (40, 64, 64, 16, 16, 1, 7),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "silu_mul,paired",
    [(False, False), (True, False), (True, True)],
    ids=["plain", "silu_mul", "silu_mul_paired"],
)
@pytest.mark.parametrize("rows,n,k,block_n,block_k,split_k,groups", BALANCED)
def test_balanced_groups_match_reference(
    dtype, silu_mul, paired, rows, n, k, block_n, block_k, split_k, groups
):
    x, weight = _operands(rows, 2 * n if silu_mul else n, k, dtype, rows + n + k + groups)
    bias = None if silu_mul else randn(n, g=gen(n), dtype=dtype)
    config = LinearConfig(
        "skinny", block_n, block_k, 4, block_rows(rows), split_k, 2, paired, groups
    )
    with poisoned():
        out = skinny_gemm_with(x, weight, bias, config, silu_mul=silu_mul)
    want = _reference(x, weight, silu_mul, bias)
    if silu_mul and not CUDA and dtype == torch.bfloat16:
        gate, up = _truncated(x.float() @ weight.float().T).chunk(2, dim=-1)
        want = _truncated(torch.nn.functional.silu(gate) * up).to(dtype)
    check(out, want, f"balanced rows={rows} n={n} k={k} {config}")
    assert _counters_clear(), "a split launch left a tile counter set"


def test_balanced_groups_must_cover_the_features():
    x = torch.zeros(4, 32, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(40, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="cannot cover 40 features"):
        skinny_gemm(x, w, None, 16, 32, 1, groups=2)  # 20 a program, past the tile
    with pytest.raises(ValueError, match="cannot cover 40 features"):
        skinny_gemm(x, w, None, 16, 32, 1, groups=41)  # a program with none


@pytest.mark.parametrize("split_k", [1, 3])
def test_bias_is_added_once_over_the_splits(split_k):
    dtype = torch.float16
    x, weight = _operands(6, 40, 96, dtype, 7)
    bias = randn(40, g=gen(8), dtype=dtype)
    with poisoned():
        out = skinny_gemm(x, weight, bias, 16, 32, split_k)
    check(out, _reference(x, weight, False, bias), f"bias split={split_k}")


def test_strided_rows_and_padding_rows_are_never_written():
    dtype = torch.float16
    x, weight = _operands(5, 40, 64, dtype, 11)
    wide = torch.cat([x, x], dim=1)[:, :64]  # rows 128 elements apart
    out = skinny_gemm(wide, weight, None, 16, 32, 2)
    assert out.shape == (5, 40)
    check(out, _reference(x, weight, False), "strided rows")


def test_silu_mul_gates_each_feature_by_its_own_gate():
    """A gate of zero gives zeros whatever ``up`` is; a gate of 2 on every feature gives
    ``silu(2) * up`` feature by feature, so a swapped or shifted half shows."""
    n, k, rows = 37, 64, 3
    x = torch.ones(rows, k, dtype=torch.float16, device=DEVICE) / k
    up = torch.arange(n, dtype=torch.float32)[:, None].expand(n, k)
    zero_gate = torch.cat([torch.zeros(n, k), up]).to(torch.float16).to(DEVICE)
    assert torch.count_nonzero(skinny_gemm(x, zero_gate, None, 16, 32, 2, silu_mul=True)) == 0
    gate_up = torch.cat([torch.full((n, k), 2.0), up]).to(torch.float16).to(DEVICE)
    got = skinny_gemm(x, gate_up, None, 16, 32, 2, silu_mul=True).float().cpu()
    want = torch.nn.functional.silu(torch.tensor(2.0)) * torch.arange(n, dtype=torch.float32)
    torch.testing.assert_close(got, want.expand(rows, n), rtol=2e-3, atol=1e-3)


def test_bad_shapes_are_refused():
    x = torch.zeros(65, 32, dtype=torch.float16, device=DEVICE)
    w = torch.zeros(16, 32, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="1-64 rows"):
        skinny_gemm(x, w, None, 16, 32, 1)
    with pytest.raises(ValueError, match="gate"):
        skinny_gemm(x[:4], w[:15], None, 16, 32, 1, silu_mul=True)
    with pytest.raises(ValueError, match="no bias"):
        skinny_gemm(x[:4], w, w[:, 0], 16, 32, 1, silu_mul=True)
    with pytest.raises(ValueError, match="unit-stride"):
        skinny_gemm(x[:4], w[:, :16], None, 16, 32, 1)


def test_block_rows_pads_to_the_tensor_core_tiles():
    assert [block_rows(r) for r in (1, 2, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]


def test_rule_splits_narrow_projections_and_not_wide_ones():
    narrow = skinny_rule(8, 2560, 4096)
    assert narrow.kind == "skinny" and narrow.block_m == 16 and narrow.split_k == 8
    assert skinny_rule(8, 151936, 2560).split_k == 1  # the LM head fills the GPU alone
    fused = skinny_rule(40, 19456, 2560, silu_mul=True)
    assert fused.block_m == 64 and fused.split_k == 2  # 152 tiles of the 9,728 outputs


def test_table_picks_per_padded_rows_and_shape(monkeypatch, tmp_path):
    entries = [
        {"block_m": 16, "n": 2560, "k": 4096, "silu_mul": False, "kind": "skinny",
         "block_n": 32, "block_k": 256, "num_warps": 4, "split_k": 4, "num_stages": 5},
        {"block_m": 32, "n": 2560, "k": 4096, "silu_mul": False, "kind": "cublas"},
        {"block_m": 16, "n": 19456, "k": 2560, "silu_mul": True, "kind": "skinny",
         "block_n": 64, "block_k": 128, "num_warps": 4, "split_k": 1, "num_stages": 4,
         "paired": True},
        {"block_m": 32, "n": 6144, "k": 2560, "silu_mul": False, "kind": "skinny",
         "block_n": 64, "block_k": 128, "num_warps": 4, "split_k": 1, "num_stages": 6,
         "groups": 132},
    ]  # fmt: skip
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "entries": entries}))
    monkeypatch.setenv("PEGAINFER_LINEAR_TABLE", str(path))
    want = LinearConfig("skinny", 32, 256, 4, 16, 4, 5)
    assert parse_table(json.loads(path.read_text()))[(16, 2560, 4096, False)] == want
    assert skinny_config(2, 2560, 4096) == want
    assert skinny_config(16, 2560, 4096) == want  # same padded rows
    assert skinny_config(24, 2560, 4096) is None  # the table says cuBLAS
    fused = skinny_config(8, 19456, 2560, silu_mul=True)
    assert fused.block_n == 64 and fused.paired
    assert not skinny_config(2, 2560, 4096).paired  # no field: one loop after the other
    assert skinny_config(2, 2560, 4096).groups == 0  # no field: whole tiles
    assert skinny_config(32, 6144, 2560).groups == 132
    assert skinny_config(8, 19456, 2560) == skinny_rule(8, 19456, 2560)  # not in the table
    assert skinny_config(40, 19456, 2560) is None  # nor that: past 32 rows cuBLAS
    monkeypatch.setenv("PEGAINFER_SKINNY_GEMM", "0")
    assert skinny_config(2, 2560, 4096) is None


def test_fused_dispatch_runs_the_references_on_cpu():
    x = torch.randn(3, 16).to(torch.bfloat16)
    w = torch.randn(12, 16).to(torch.bfloat16)
    assert torch.equal(linear_silu_and_mul(x, w), linear_silu_and_mul_ref(x, w))


# Qwen3-4B projections: (name, N, K, fused silu-and-mul).
REAL = [
    ("qkv", 6144, 2560, False),
    ("o", 2560, 4096, False),
    ("gate_up", 19456, 2560, True),
    ("down", 2560, 9728, False),
    ("lm_head", 151936, 2560, False),
]


@gpu_only
@pytest.mark.parametrize("rows", [2, 8, 24, 32, 64])
@pytest.mark.parametrize("name,n,k,silu_mul", REAL, ids=[r[0] for r in REAL])
def test_real_shapes_with_the_picked_tiles_in_a_graph(name, n, k, silu_mul, rows):
    """The tile the dispatch picks, captured in a CUDA graph and replayed on fresh inputs
    twice: a counter a replay failed to clear would show in the second."""
    config = skinny_config(rows, n, k, silu_mul) or skinny_rule(rows, n, k, silu_mul)
    x, weight = _operands(rows, n, k, torch.bfloat16, rows + n)

    def run() -> torch.Tensor:
        return skinny_gemm_with(x, weight, None, config, silu_mul=silu_mul)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for replay in range(2):
        x.copy_(randn(rows, k, g=gen(100 + replay), dtype=torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        check(out, _reference(x, weight, silu_mul), f"{name} rows={rows} {config} #{replay}")
    assert _counters_clear()


@gpu_only
@pytest.mark.parametrize("silu_mul", [False, True], ids=["plain", "silu_mul"])
def test_split_sum_has_the_same_bits_whichever_split_arrives_last(silu_mul):
    """Eight splits of a tile finish in a different order on each launch; the last one adds
    every split in split order, so 30 launches on one input give one result (float addition
    is not associative: adding in arrival order gave replays that differed in the last bit)."""
    rows, n, k = 8, 2048 * (2 if silu_mul else 1), 8192
    config = LinearConfig("skinny", 64, 128, 4, block_rows(rows), split_k=8, num_stages=4)
    x, weight = _operands(rows, n, k, torch.bfloat16, 77)
    first = skinny_gemm_with(x, weight, None, config, silu_mul=silu_mul)
    check(first, _reference(x, weight, silu_mul), f"split 8 {config}")
    for launch in range(30):
        again = skinny_gemm_with(x, weight, None, config, silu_mul=silu_mul)
        assert torch.equal(again, first), f"launch {launch} differs"
    assert _counters_clear()
