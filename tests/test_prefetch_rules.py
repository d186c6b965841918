"""How many weight tiles each linear kernel reads before its PDL wait, and the tiles that
reading them changes (kernels/linear_configs.py): host-side rules, checked without a GPU.
That the early tiles give the same bits as none: tests/test_kernels_linear_norm.py and
tests/test_kernels_linear_fused.py."""

from __future__ import annotations

import pytest

from kernels.linear import AFTER_STREAM, LinearConfig
from kernels.linear_configs import (
    GATE_UP_PREFETCH_TILES,
    GEMV_PREFETCH_TILES,
    GEMV_STREAM_PREFETCH_TILES,
    MAX_PREFETCH_TILES,
    ROWS_GATE_UP_PREFETCH_TILES,
    ROWS_GEMV_PREFETCH_TILES,
    SKINNY_PREFETCH_TILES,
    SKINNY_STREAM_PREFETCH_TILES,
    fused_gate_up_block_n,
    gate_up_prefetch_tiles,
    pick_config,
    prefetch_tiles,
    prefetching_gemv_config,
    rows_gate_up_prefetch_tiles,
)


def test_prefetch_tiles_stay_within_the_weight(monkeypatch):
    monkeypatch.delenv("PEGAINFER_GEMV_PREFETCH_TILES", raising=False)
    monkeypatch.delenv("PEGAINFER_SKINNY_PREFETCH_TILES", raising=False)
    o_gemv = LinearConfig("gemv", 2, 1024, 4)
    assert prefetch_tiles(o_gemv, 4096) == GEMV_PREFETCH_TILES
    assert prefetch_tiles(o_gemv, 900) == 1  # all of K in one tile
    rows_o = LinearConfig("gemv", 2, 1024, 4, block_m=2)
    assert prefetch_tiles(rows_o, 4096) == ROWS_GEMV_PREFETCH_TILES == 1
    assert prefetch_tiles(rows_o, 9728, AFTER_STREAM) == ROWS_GEMV_PREFETCH_TILES == 1
    o_skinny = LinearConfig("skinny", 64, 128, 4, 16, 3, 4)
    assert prefetch_tiles(o_skinny, 4096) == SKINNY_PREFETCH_TILES
    assert prefetch_tiles(o_skinny, 3 * 128) == 1  # one tile a split
    # After a bandwidth-bound kernel: two one-row tiles (down, qkv), none for the skinny GEMM.
    monkeypatch.delenv("PEGAINFER_GEMV_STREAM_PREFETCH_TILES", raising=False)
    monkeypatch.delenv("PEGAINFER_SKINNY_STREAM_PREFETCH_TILES", raising=False)
    assert prefetch_tiles(o_gemv, 9728, AFTER_STREAM) == GEMV_STREAM_PREFETCH_TILES == 2
    assert prefetch_tiles(o_skinny, 9728, AFTER_STREAM) == 0  # 16 rows
    down_32 = LinearConfig("skinny", 64, 128, 4, 32, 3, 4)
    assert prefetch_tiles(down_32, 9728, AFTER_STREAM) == SKINNY_STREAM_PREFETCH_TILES == 1
    monkeypatch.setenv("PEGAINFER_GEMV_STREAM_PREFETCH_TILES", "1")
    assert prefetch_tiles(o_gemv, 9728, AFTER_STREAM) == 1
    monkeypatch.setenv("PEGAINFER_SKINNY_STREAM_PREFETCH_TILES", "1")
    assert prefetch_tiles(o_skinny, 9728, AFTER_STREAM) == 1
    with pytest.raises(ValueError, match="unknown prefetch"):
        prefetch_tiles(o_gemv, 4096, "after_all")
    monkeypatch.setenv("PEGAINFER_GEMV_PREFETCH_TILES", "0")
    assert prefetch_tiles(o_gemv, 4096) == 0
    monkeypatch.setenv("PEGAINFER_SKINNY_PREFETCH_TILES", "9")
    assert prefetch_tiles(o_skinny, 4096 * 4) == MAX_PREFETCH_TILES


def test_the_fused_gate_up_reads_two_tiles_early_in_programs_of_two_features(monkeypatch):
    monkeypatch.delenv("PEGAINFER_GATE_UP_PREFETCH_TILES", raising=False)
    monkeypatch.delenv("PEGAINFER_LINEAR_TILES", raising=False)
    assert gate_up_prefetch_tiles(2560, 512) == GATE_UP_PREFETCH_TILES == 2
    assert gate_up_prefetch_tiles(300, 512) == 1  # all of K in one tile
    assert gate_up_prefetch_tiles(4096, 1024) == 2  # Qwen3-8B and larger: half of K
    assert gate_up_prefetch_tiles(1024, 1024) == 1
    assert fused_gate_up_block_n(1, 19456, 2560, prefetching=True) == 2
    assert fused_gate_up_block_n(1, 19456, 2560, prefetching=False) == 1
    assert fused_gate_up_block_n(4, 19456, 2560, prefetching=True) == 4
    monkeypatch.setenv("PEGAINFER_LINEAR_TILES", "19456,2560=4,512,2")
    assert fused_gate_up_block_n(1, 19456, 2560, prefetching=True) == 1  # set by hand
    monkeypatch.setenv("PEGAINFER_GATE_UP_PREFETCH_TILES", "0")
    assert gate_up_prefetch_tiles(2560, 512) == 0
    monkeypatch.setenv("PEGAINFER_GATE_UP_PREFETCH_TILES", "1")
    assert gate_up_prefetch_tiles(4096, 1024) == 1
    monkeypatch.setenv("PEGAINFER_GATE_UP_PREFETCH_TILES", "7")
    assert gate_up_prefetch_tiles(2560, 512) == MAX_PREFETCH_TILES


def test_the_two_row_fused_gate_up_reads_two_tiles_early_below_1024_wide_tiles(monkeypatch):
    monkeypatch.delenv("PEGAINFER_ROWS_GATE_UP_PREFETCH_TILES", raising=False)
    assert rows_gate_up_prefetch_tiles(2560, 512) == ROWS_GATE_UP_PREFETCH_TILES == 2
    assert rows_gate_up_prefetch_tiles(300, 512) == 1  # all of K in one tile
    assert rows_gate_up_prefetch_tiles(4096, 1024) == 0  # Qwen3-8B and larger: slower
    monkeypatch.setenv("PEGAINFER_ROWS_GATE_UP_PREFETCH_TILES", "0")
    assert rows_gate_up_prefetch_tiles(2560, 512) == 0
    monkeypatch.setenv("PEGAINFER_ROWS_GATE_UP_PREFETCH_TILES", "9")
    assert rows_gate_up_prefetch_tiles(4096, 1024) == MAX_PREFETCH_TILES


def test_a_prefetching_gemv_takes_four_features_where_the_rule_gives_two(monkeypatch):
    monkeypatch.delenv("PEGAINFER_LINEAR_TILES", raising=False)
    qkv = pick_config(1, 6144, 2560)
    assert (qkv.block_n, qkv.block_k) == (2, 512)
    assert prefetching_gemv_config(qkv, 6144, 2560) == LinearConfig(
        "gemv", 4, 512, 2, num_stages=qkv.num_stages
    )
    down = pick_config(1, 2560, 9728)  # 1,024-wide K tiles: kept
    assert prefetching_gemv_config(down, 2560, 9728) == down
    rows = pick_config(2, 6144, 2560)
    assert prefetching_gemv_config(rows, 6144, 2560) == rows
    monkeypatch.setenv("PEGAINFER_LINEAR_TILES", "6144,2560=2,512,2")
    set_by_hand = pick_config(1, 6144, 2560)
    assert prefetching_gemv_config(set_by_hand, 6144, 2560) == set_by_hand
