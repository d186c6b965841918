"""tools/tune_linear's candidate tiles, without a GPU."""

from __future__ import annotations

import pytest

from tools.tune_linear import candidates, parse_grid


def test_one_row_candidates_follow_the_grid():
    grid = parse_grid("gemv_block_n=2,4;gemv_block_k=512;gemv_warps=2;gemv_stages=1,3")
    found = candidates(1, 2560, 9728, grid=grid)
    assert {(c.block_n, c.num_stages) for c in found} == {(2, 1), (2, 3), (4, 1), (4, 3)}
    assert all(c.kind == "gemv" and c.block_k == 512 and c.num_warps == 2 for c in found)
    # A 151,936-row LM head in 2-feature tiles would need 75,968 programs in the grid's
    # second dimension, past CUDA's 65,535.
    lm_head = candidates(1, 151_936, 2560, grid=grid)
    assert {c.block_n for c in lm_head} == {4}


def test_deep_stages_that_overflow_shared_memory_are_left_out():
    grid = parse_grid("gemv_block_n=8;gemv_block_k=4096;gemv_warps=8;gemv_stages=1,2,3")
    stages = {c.num_stages for c in candidates(1, 2560, 9728, grid=grid)}
    assert stages == {1}  # (stages - 1) x 9 rows x 8 KB is over 64 KB from 2 stages on


def test_grid_names_are_checked():
    with pytest.raises(ValueError, match="gemv_stages"):
        parse_grid("stage=3")
