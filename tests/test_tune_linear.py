"""tools/tune_linear's candidate tiles, without a GPU."""

from __future__ import annotations

import pytest

from tools.tune_linear import candidates, parse_grid, projections


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


def test_grouped_candidates_take_the_smallest_tile_that_holds_a_share():
    grid = parse_grid("block_n=32,64,128;block_k=64;stages=4;split=1;groups=0,132")
    found = candidates(8, 19456, 2560, silu_mul=True, grid=grid)
    grouped = {(c.block_n, c.num_warps, c.paired) for c in found if c.groups}
    # 9,728 features over 132 programs: 73-74 each, in a 128-feature tile (4 or 8 warps).
    assert grouped == {(128, w, p) for w in (4, 8) for p in (False, True)}
    # Whole tiles of 128: 76 programs, too few to sweep.
    assert {c.block_n for c in found if not c.groups} == {32, 64}
    assert all(c.groups in (0, 132) for c in found)
    # Without a shape, no share to size a tile by: only whole tiles.
    assert not any(c.groups for c in candidates(8, grid=grid))


def test_a_mixture_preset_sweeps_its_router_at_any_program_count():
    shapes = {name: (n, k) for name, n, k in projections("30b-a3b")}
    assert shapes == {
        "qkv": (5120, 2048),
        "o": (2048, 4096),
        "router": (128, 2048),
        "lm_head": (151936, 2048),
    }
    grid = parse_grid("block_n=16,32,64;block_k=128;stages=4;split=1,2,4,8")
    found = candidates(8, 128, 2048, grid=grid)
    # 128 features make 2-8 tiles: under a hundred programs with any split of 16 K steps.
    assert {(c.block_n, c.split_k) for c in found} == {
        (n, s) for n in (16, 32, 64) for s in (1, 2, 4, 8)
    }
    # A weight of Qwen3-4B's size keeps the floor of a hundred programs.
    assert not candidates(8, 2560, 4096, grid=parse_grid("block_n=64;split=1"))


def test_grid_names_are_checked():
    with pytest.raises(ValueError, match="gemv_stages"):
        parse_grid("stage=3")


def _entry(block_m: int, n: int, stages: int, **extra) -> dict:
    return {"block_m": block_m, "n": n, "k": 2560, "silu_mul": False, "kind": "skinny",
            "block_n": 64, "block_k": 128, "num_warps": 4, "split_k": 2,
            "num_stages": stages, **extra}  # fmt: skip


def test_a_fresh_sweep_keeps_the_entries_set_by_hand():
    from kernels.linear_configs import keep_hand_set

    swept = {"entries": [_entry(16, 6144, 3), _entry(32, 6144, 3), _entry(16, 2560, 4)]}
    previous = {
        "entries": [
            _entry(16, 6144, 6, note="whole steps"),
            _entry(32, 6144, 4),  # no note: the sweep's entry replaces it
            _entry(64, 9728, 5, note="a shape this sweep left out"),
        ]
    }
    kept = keep_hand_set(swept, previous)
    assert [entry["n"] for entry in kept] == [6144, 9728]
    stages = {(e["block_m"], e["n"]): e["num_stages"] for e in swept["entries"]}
    assert stages == {(16, 2560): 4, (16, 6144): 6, (32, 6144): 3, (64, 9728): 5}


def test_the_shipped_table_says_why_each_hand_set_entry_differs():
    """Every H200 entry set by hand carries its reason and still parses to a skinny tile."""
    import json

    from kernels.linear_configs import TABLE_DIR, parse_table

    payload = json.loads((TABLE_DIR / "NVIDIA_H200.json").read_text())
    hand_set = [entry for entry in payload["entries"] if "note" in entry]
    assert {(e["block_m"], e["n"], e["k"]) for e in hand_set} == {
        (16, 2560, 4096),
        (16, 6144, 2560),
        (32, 6144, 2560),
        (16, 19456, 2560),
        (32, 19456, 2560),
    }
    table = parse_table(payload)
    for entry in hand_set:
        assert len(entry["note"]) > 40
        config = table[(entry["block_m"], entry["n"], entry["k"], entry["silu_mul"])]
        assert config is not None and config.num_stages == entry["num_stages"]
        assert config.groups == entry.get("groups", 0)


def test_emitting_a_table_over_one_with_hand_set_entries(tmp_path, capsys):
    import json

    from tools.linear_table import write_table

    best = _entry(16, 6144, 3, paired=False)
    records = [
        {"rows": 8, "n": 6144, "k": 2560, "silu_mul": False, "best": best, "best_us": 10.0,
         "cublas_us": 11.0},
        {"rows": 8, "n": 2560, "k": 2560, "silu_mul": False, "best": best, "best_us": 10.0,
         "cublas_us": 10.1},  # within --min-gain of cuBLAS
    ]  # fmt: skip
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": [_entry(16, 6144, 6, note="whole steps")]}))
    write_table(records, str(path), 0.02, "test", keep_notes=True)
    entries = {e["n"]: e for e in json.loads(path.read_text())["entries"]}
    assert entries[6144]["num_stages"] == 6 and entries[6144]["note"] == "whole steps"
    assert entries[2560]["kind"] == "cublas"
    assert "kept the hand-set entry of 16 rows, 6144 x 2560" in capsys.readouterr().out
    write_table(records, str(path), 0.02, "test", keep_notes=False)
    entries = {e["n"]: e for e in json.loads(path.read_text())["entries"]}
    assert entries[6144]["num_stages"] == 3 and "note" not in entries[6144]
