"""The split policy of decode attention (kernels/decode_splits.py): host integers only, so
these run anywhere; the kernel itself is held to its reference in
tests/test_kernels_decode_attention.py."""

import pytest
import torch

from kernels import decode_splits
from kernels.decode_splits import MAX_SPLITS, choose_max_splits, merge_splits_pad


def test_decode_split_policy():
    """A batch is split until about three programs per SM (132 SMs off CUDA) are in flight,
    never below the minimum split length at the graph's context bound, nor past MAX_SPLITS."""
    cpu = torch.device("cpu")
    splits = {n: choose_max_splits(n, 8, 40960, cpu) for n in (1, 8, 16, 24, 32, 64, 256)}
    assert splits == {1: MAX_SPLITS, 8: 6, 16: 3, 24: 2, 32: 2, 64: 1, 256: 1}
    assert choose_max_splits(1, 2, 40960, cpu) == MAX_SPLITS
    assert choose_max_splits(1, 8, 100, cpu, min_split_tokens=64) == 2


def test_decode_merge_tile():
    """Grids of up to 32 splits share the merge's 32-split tile (one compiled variant); a
    larger one gets a tile that holds every split."""
    assert {merge_splits_pad(n) for n in (1, 2, 6, 17, 32)} == {32}
    assert merge_splits_pad(MAX_SPLITS) >= MAX_SPLITS
    assert merge_splits_pad(33) == 64


def test_shortest_split_setting(monkeypatch):
    """``PEGAINFER_DECODE_MIN_SPLIT`` replaces the shortest split, read once; a count below
    1 is refused."""
    cache = decode_splits.min_split_tokens_now
    try:
        monkeypatch.delenv("PEGAINFER_DECODE_MIN_SPLIT", raising=False)
        cache.cache_clear()
        assert cache() == decode_splits.MIN_SPLIT_TOKENS
        monkeypatch.setenv("PEGAINFER_DECODE_MIN_SPLIT", "256")
        assert cache() == decode_splits.MIN_SPLIT_TOKENS  # read once
        cache.cache_clear()
        assert cache() == 256
        monkeypatch.setenv("PEGAINFER_DECODE_MIN_SPLIT", "0")
        cache.cache_clear()
        with pytest.raises(ValueError, match="PEGAINFER_DECODE_MIN_SPLIT"):
            cache()
    finally:
        monkeypatch.delenv("PEGAINFER_DECODE_MIN_SPLIT", raising=False)
        cache.cache_clear()


def test_decode_tile_settings(monkeypatch):
    """``PEGAINFER_DECODE_BLOCK_N`` / ``_STAGES`` / ``_WARPS`` replace decode attention's tile,
    read once; unset they leave the rule's; anything but a positive integer is refused."""
    names = ("PEGAINFER_DECODE_BLOCK_N", "PEGAINFER_DECODE_STAGES", "PEGAINFER_DECODE_WARPS")
    cache = decode_splits.decode_tile_now
    try:
        for name in names:
            monkeypatch.delenv(name, raising=False)
        cache.cache_clear()
        assert cache() == (None, None, None)
        monkeypatch.setenv("PEGAINFER_DECODE_BLOCK_N", "128")
        monkeypatch.setenv("PEGAINFER_DECODE_WARPS", "8")
        assert cache() == (None, None, None)  # read once
        cache.cache_clear()
        assert cache() == (128, None, 8)
        for bad in ("0", "-2", "x"):
            monkeypatch.setenv("PEGAINFER_DECODE_STAGES", bad)
            cache.cache_clear()
            with pytest.raises(ValueError, match="PEGAINFER_DECODE_STAGES"):
                cache()
    finally:
        for name in names:
            monkeypatch.delenv(name, raising=False)
        cache.cache_clear()
