"""Per-sequence state held by a worker, and the flat batch built from it each step.

Two builders:

- ``layout_step`` (serving): host-side arrays of one step, padded for a CUDA graph when
  asked, with the tokens that are still on the device (sampled by the step before, not yet
  copied back) marked for a device-side fill. The runner uploads the arrays in one copy.
- ``build_batch`` (profiling and ``prefill_logits``): a self-contained ``StepBatch`` from
  host tokens and explicit block tables, with no persistent device state involved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pegainfer.protocol import SamplingParams
from worker_proc.forward_context import ForwardContext

# Spans longer than this get their KV slots computed with numpy instead of a comprehension.
_VECTOR_SPAN = 16


@dataclass(eq=False)
class SequenceState:
    """What a worker keeps for one live sequence between steps.

    ``token_ids`` are the tokens known on the host: the prompt (plus, for a preempted
    sequence, what it had generated) and the sampled tokens whose step results have been
    copied back. ``num_tokens`` also counts sampled tokens still on their way back; only the
    newest of those can be an input of a later step, and it is read from ``last_token`` of
    the sequence's ``slot`` on the device. ``block_table`` grows by the plans' updates.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_table: list[int] = field(default_factory=list)
    slot: int = -1
    num_tokens: int = -1  # -1: len(token_ids)
    serial: int = 0  # unique per admission: keys the sampler's per-batch cache

    def __post_init__(self) -> None:
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)

    @property
    def num_unresolved(self) -> int:
        """Sampled tokens not yet copied back to the host."""
        return self.num_tokens - len(self.token_ids)


class TokensNotOnHost(Exception):
    """A step needs a token that is neither on the host nor the newest one sampled."""


@dataclass
class StepLayout:
    """Host arrays of one step. Rows ``num_seqs .. num_rows - 1`` are graph padding: token
    0 at position 0, KV slot -1 (nothing is written), context length 1 over the scratch
    slot's block table row."""

    num_seqs: int
    num_rows: int
    max_query_len: int
    max_context_len: int
    max_blocks: int
    sample_rows: list[int]
    # int64 arrays
    input_ids: np.ndarray  # [num_tokens]
    positions: np.ndarray  # [num_tokens]
    slot_mapping: np.ndarray  # [num_tokens]
    row_slots: np.ndarray  # [num_rows] slot of each row (block table row to gather)
    pending_index: np.ndarray  # [P] flat token rows whose id is on the device
    pending_slot: np.ndarray  # [P] the slots holding those ids
    sample_index: np.ndarray  # [S] flat token rows that sample
    sample_slot: np.ndarray  # [S] slots of the sampling sequences
    sample_pos: np.ndarray  # [S] position of the token each sampling row draws
    # int32 arrays
    context_lens: np.ndarray  # [num_rows]
    query_lens: np.ndarray  # [num_rows]
    query_start_loc: np.ndarray  # [num_rows + 1]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def arrays(self) -> list[np.ndarray]:
        """In the order ``upload_order`` names them."""
        return [getattr(self, name) for name in UPLOAD_ORDER]


UPLOAD_ORDER = (
    "input_ids",
    "positions",
    "slot_mapping",
    "row_slots",
    "pending_index",
    "pending_slot",
    "sample_index",
    "sample_slot",
    "sample_pos",
    "context_lens",
    "query_lens",
    "query_start_loc",
)


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    if end - start == 1:
        return [table[start // block_size] * block_size + start % block_size]
    if end - start < _VECTOR_SPAN:
        return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
    first = start // block_size
    blocks = np.asarray(table[first : (end - 1) // block_size + 1], dtype=np.int64)
    span = np.arange(start, end, dtype=np.int64)
    return (blocks[span // block_size - first] * block_size + span % block_size).tolist()


def _i64(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _i32(values: list[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def layout_step(
    seqs: list[SequenceState],
    num_computed: list[int],
    num_scheduled: list[int],
    block_size: int,
    num_rows: int | None = None,
    scratch_slot: int = 0,
) -> StepLayout:
    """Flatten the step: sequence i contributes tokens ``num_computed[i] : num_computed[i] +
    num_scheduled[i]``, and samples when that reaches its ``num_tokens``. ``num_rows`` pads
    the batch (one token per padding row, for a decode graph). Callers validate first.

    Raises ``TokensNotOnHost`` when an input token is still on the device and is not the
    sequence's newest (the caller copies the results back and retries)."""
    rows = len(seqs) if num_rows is None else num_rows
    if rows < len(seqs):
        raise ValueError(f"cannot pad {len(seqs)} sequences down to {rows} rows")
    if max(num_scheduled) == 1:
        return _layout_decode(seqs, num_computed, block_size, rows, scratch_slot)
    return _layout_general(seqs, num_computed, num_scheduled, block_size, rows, scratch_slot)


def _layout_decode(
    seqs: list[SequenceState],
    num_computed: list[int],
    block_size: int,
    rows: int,
    scratch_slot: int,
) -> StepLayout:
    """``layout_step`` for one token per sequence: the hot path of steady decoding, with
    one short loop and the per-row columns that follow from ``num_computed`` built whole."""
    num_seqs = len(seqs)
    padding = rows - num_seqs
    input_ids = [0] * rows
    slot_mapping = [-1] * rows
    row_slots = [scratch_slot] * rows
    pending_index: list[int] = []
    pending_slot: list[int] = []
    sample_rows: list[int] = []
    for row, (seq, position) in enumerate(zip(seqs, num_computed)):
        tokens = seq.token_ids
        samples = position + 1 == seq.num_tokens
        if position < len(tokens):
            input_ids[row] = tokens[position]
        elif samples:  # the newest token, still on the device
            pending_index.append(row)
            pending_slot.append(seq.slot)
        else:
            raise TokensNotOnHost(f"sequence {seq.seq_id} needs token {position}")
        block = seq.block_table[position // block_size]
        slot_mapping[row] = block * block_size + position % block_size
        row_slots[row] = seq.slot
        if samples:
            sample_rows.append(row)
    context_lens = [position + 1 for position in num_computed]
    return StepLayout(
        num_seqs=num_seqs,
        num_rows=rows,
        max_query_len=1,
        max_context_len=max(context_lens),
        max_blocks=-(-max(context_lens) // block_size),
        sample_rows=sample_rows,
        input_ids=_i64(input_ids),
        positions=_i64(list(num_computed) + [0] * padding),
        slot_mapping=_i64(slot_mapping),
        row_slots=_i64(row_slots),
        pending_index=_i64(pending_index),
        pending_slot=_i64(pending_slot),
        sample_index=_i64(sample_rows),  # one token per row: token index == row
        sample_slot=_i64([row_slots[row] for row in sample_rows]),
        sample_pos=_i64([context_lens[row] for row in sample_rows]),
        context_lens=_i32(context_lens + [1] * padding),
        query_lens=np.ones(rows, dtype=np.int32),
        query_start_loc=np.arange(rows + 1, dtype=np.int32),
    )


def _layout_general(
    seqs: list[SequenceState],
    num_computed: list[int],
    num_scheduled: list[int],
    block_size: int,
    rows: int,
    scratch_slot: int,
) -> StepLayout:
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    row_slots: list[int] = []
    pending_index: list[int] = []
    pending_slot: list[int] = []
    sample_rows: list[int] = []
    sample_index: list[int] = []
    sample_slot: list[int] = []
    sample_pos: list[int] = []
    context_lens: list[int] = []
    query_start_loc = [0]
    for row, (seq, start, count) in enumerate(zip(seqs, num_computed, num_scheduled)):
        end = start + count
        on_host = len(seq.token_ids)
        if end <= on_host:
            input_ids.extend(seq.token_ids[start:end])
        elif end == seq.num_tokens and (count == 1 or on_host >= end - 1):
            # The newest token only: it is on the device (older ones may be too, unused).
            input_ids.extend(seq.token_ids[start : end - 1])
            pending_index.append(len(input_ids))
            pending_slot.append(seq.slot)
            input_ids.append(0)  # filled from last_token on the device
        else:
            raise TokensNotOnHost(f"sequence {seq.seq_id} needs tokens up to {end}")
        positions.extend(range(start, end))
        slot_mapping.extend(_slots(seq.block_table, start, end, block_size))
        row_slots.append(seq.slot)
        context_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + count)
        if end == seq.num_tokens:
            sample_rows.append(row)
            sample_index.append(query_start_loc[-1] - 1)
            sample_slot.append(seq.slot)
            sample_pos.append(end)

    num_seqs = len(seqs)
    max_query_len = max(num_scheduled)
    max_context_len = max(context_lens)
    padding = rows - num_seqs
    if padding:
        input_ids.extend([0] * padding)
        positions.extend([0] * padding)
        slot_mapping.extend([-1] * padding)
        row_slots.extend([scratch_slot] * padding)
        context_lens.extend([1] * padding)
        last = query_start_loc[-1]
        query_start_loc.extend(range(last + 1, last + padding + 1))
    query_lens = list(num_scheduled) + [1] * padding
    i64, i32 = _i64, _i32
    return StepLayout(
        num_seqs=num_seqs,
        num_rows=rows,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
        max_blocks=-(-max_context_len // block_size),
        sample_rows=sample_rows,
        input_ids=i64(input_ids),
        positions=i64(positions),
        slot_mapping=i64(slot_mapping),
        row_slots=i64(row_slots),
        pending_index=i64(pending_index),
        pending_slot=i64(pending_slot),
        sample_index=i64(sample_index),
        sample_slot=i64(sample_slot),
        sample_pos=i64(sample_pos),
        context_lens=i32(context_lens),
        query_lens=i32(query_lens),
        query_start_loc=i32(query_start_loc),
    )


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    context: ForwardContext
    # Batch rows whose last scheduled token reaches the end of their known tokens: they
    # sample. ``sample_token_index`` are those tokens' rows in the flat hidden states.
    sample_rows: list[int]
    sample_token_index: torch.Tensor  # [len(sample_rows)] int64


def build_batch(
    token_lists: list[list[int]],
    block_tables: list[list[int]],
    num_computed: list[int],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
) -> StepBatch:
    """A self-contained batch over explicit tokens and block tables (all on the host)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    block_rows: list[list[int]] = []
    context_lens: list[int] = []
    query_start_loc = [0]
    sample_rows: list[int] = []
    sample_token_index: list[int] = []
    for row, (tokens, table, start, count) in enumerate(
        zip(token_lists, block_tables, num_computed, num_scheduled)
    ):
        end = start + count
        input_ids.extend(tokens[start:end])
        positions.extend(range(start, end))
        slot_mapping.extend(_slots(table, start, end, block_size))
        block_rows.append(table[: -(-end // block_size)])
        context_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + count)
        if end == len(tokens):
            sample_rows.append(row)
            sample_token_index.append(query_start_loc[-1] - 1)

    max_blocks = max(len(r) for r in block_rows)
    padded_tables = [r + [0] * (max_blocks - len(r)) for r in block_rows]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    context = ForwardContext(
        slot_mapping=tensor(slot_mapping, torch.int64),
        block_tables=tensor(padded_tables, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        query_lens=tensor(num_scheduled, torch.int32),
        query_start_loc=tensor(query_start_loc, torch.int32),
        max_query_len=max(num_scheduled),
        max_context_len=max(context_lens),
        num_seqs=len(token_lists),
        num_tokens=len(input_ids),
    )
    return StepBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        context=context,
        sample_rows=sample_rows,
        sample_token_index=tensor(sample_token_index, torch.int64),
    )
