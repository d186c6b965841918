"""The worker's host-side preparation of a step, before the device runs it: the decode
layout's whole-column shortcuts against the general layout, and the uploader's reuse of its
views (every returned tensor holds its own arrays until the ring comes round)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pegainfer.protocol import SamplingParams
from worker_proc.batch import (
    UPLOAD_ORDER,
    SequenceState,
    TokensNotOnHost,
    _layout_general,
    layout_step,
)
from worker_proc.upload import Uploader, _Slot

GREEDY = SamplingParams(temperature=0.0)

decode_row = st.fixed_dictionaries(
    {
        "on_host": st.integers(1, 40),
        "unresolved": st.sampled_from([0, 1, 1, 2]),
        "samples": st.booleans(),
        "slot": st.integers(0, 30),
    }
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(decode_row, min_size=1, max_size=12),
    steady=st.sampled_from([None, 0, 1]),  # every row samples with this many on the device
    block_size=st.sampled_from([1, 2, 4, 16]),
    padding=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_decode_layout_equals_the_general_layout(rows, steady, block_size, padding, seed):
    rng = random.Random(seed)
    seqs, computed = [], []
    for index, row in enumerate(rows):
        unresolved = row["unresolved"] if steady is None else steady
        num_tokens = row["on_host"] + unresolved
        samples = row["samples"] or steady is not None
        position = num_tokens - 1 if samples else rng.randrange(num_tokens)
        table = [rng.randrange(1000) for _ in range(position // block_size + 1)]
        tokens = [rng.randrange(100) for _ in range(row["on_host"])]
        seqs.append(
            SequenceState(
                index, tokens, 1, GREEDY, block_table=table, slot=row["slot"], num_tokens=num_tokens
            )
        )
        computed.append(position)
    num_rows = len(seqs) + padding
    ones = [1] * len(seqs)
    try:
        want = _layout_general(seqs, computed, ones, block_size, num_rows, 31)
    except TokensNotOnHost:
        with pytest.raises(TokensNotOnHost):
            layout_step(seqs, computed, ones, block_size, num_rows, 31)
        return
    got = layout_step(seqs, computed, ones, block_size, num_rows, 31)
    assert got.sample_rows == want.sample_rows
    for name in UPLOAD_ORDER:
        mine, theirs = getattr(got, name), getattr(want, name)
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape, name
        assert np.array_equal(mine, theirs), name
    for name in ("num_seqs", "num_rows", "max_query_len", "max_context_len", "max_blocks"):
        assert getattr(got, name) == getattr(want, name), name


def _arrays(rng: np.random.Generator, shape_seed: int) -> list[np.ndarray]:
    """Arrays of a few signatures (dtypes and shapes), fresh contents every call."""
    shapes = random.Random(shape_seed)
    arrays = []
    for _ in range(shapes.randrange(1, 5)):
        dtype = shapes.choice([np.int64, np.int32, np.float32, np.bool_])
        shape = shapes.choice([(0,), (1,), (5,), (2, 3)])
        arrays.append(rng.integers(0, 100, size=shape).astype(dtype))
    return arrays


@settings(max_examples=60, deadline=None)
@given(
    shape_seeds=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    ring_size=st.integers(1, 4),
    initial_bytes=st.sampled_from([8, 64, 1 << 12]),
)
def test_uploads_hold_their_arrays_until_the_ring_comes_round(
    shape_seeds, ring_size, initial_bytes
):
    uploader = Uploader(torch.device("cpu"), ring_size=ring_size, initial_bytes=initial_bytes)
    rng = np.random.default_rng(0)
    recent: list[tuple[list[np.ndarray], list[torch.Tensor]] | None] = []
    kept = []
    for step, shape_seed in enumerate(shape_seeds):
        arrays = _arrays(rng, shape_seed)
        if step % 7 == 3:  # it takes its turn in the ring, too
            kept.append((arrays, uploader.upload(arrays, persistent=True)))
            recent.append(None)
        else:
            recent.append((arrays, uploader.upload(arrays)))
        recent = recent[-ring_size:]  # older views may be overwritten now
        for sent, got in [r for r in recent if r is not None] + kept:
            for array, tensor in zip(sent, got):
                assert tensor.dtype == torch.from_numpy(array).dtype
                assert tuple(tensor.shape) == array.shape
                assert np.array_equal(tensor.numpy(), array)


def test_a_slot_keeps_a_bounded_number_of_placements():
    uploader = Uploader(torch.device("cpu"), ring_size=1)
    for size in range(_Slot.MAX_PLACEMENTS * 2):
        (got,) = uploader.upload([np.full(size + 1, size, dtype=np.int64)])
        assert got.tolist() == [size] * (size + 1)
        assert len(uploader._ring[0].placements) <= _Slot.MAX_PLACEMENTS


def test_the_host_step_microbenchmarks_run():
    from tools.bench_host_micro import (
        WORKER_PREP,
        host_step_summary,
        protocol_micro,
        scheduler_micro,
        worker_micro,
    )

    rows = protocol_micro([8], 5) + scheduler_micro([8], 30) + worker_micro([8], 30)
    assert {r["what"] for r in rows} >= {WORKER_PREP, "encode TokenOutputs"}
    assert all(r["median_us"] > 0 for r in rows)
    summary = host_step_summary(rows, 8)
    assert summary is not None
    assert summary["full_host_us"] == pytest.approx(
        summary["target_measure_us"] + summary["worker_prep_us"] + summary["outputs_encode_us"]
    )
    assert host_step_summary(rows, 64) is None  # nothing measured at that batch


def test_live_sequences_hold_a_penalty_row_while_penalised():
    from pegainfer.protocol import NewSequence, StepPlan, pack_ids
    from worker_proc.live_seqs import LiveSequences
    from worker_proc.penalties import PenaltyTable
    from worker_proc.seq_slots import SlotTable

    device = torch.device("cpu")
    uploader = Uploader(device)
    table = PenaltyTable(100, device, uploader)
    live = LiveSequences(SlotTable(4, 4, device), uploader, 100, 16, 4, table)
    penalised = SamplingParams(repetition_penalty=1.2)
    live.apply_diffs(
        StepPlan(0, [NewSequence(1, pack_ids([5]), GREEDY, 1)], b"", b"", b"", [], b"")
    )
    assert live.seqs[1].penalty_row == -1 and table.rows_in_use == 0
    live.apply_diffs(
        StepPlan(1, [NewSequence(2, pack_ids([5, 6]), penalised, 1)], b"", b"", b"", [], b"")
    )
    row = live.seqs[2].penalty_row
    assert row >= 0 and table.rows_in_use == 1
    assert table.prompt_seen[row, 5] and table.counts[row, 6] == 1
    live.apply_diffs(StepPlan(2, [], b"", b"", b"", [], pack_ids([1])))
    assert table.rows_in_use == 1
    live.apply_diffs(StepPlan(3, [], b"", b"", b"", [], pack_ids([2])))
    assert table.rows_in_use == 0
    # A rank that does not sample keeps no table.
    other = LiveSequences(SlotTable(4, 4, device), uploader, 100, 16, 4)
    other.apply_diffs(
        StepPlan(0, [NewSequence(2, pack_ids([5]), penalised, 1)], b"", b"", b"", [], b"")
    )
    assert other.seqs[2].penalty_row == -1
