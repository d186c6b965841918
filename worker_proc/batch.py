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
    penalty_row: int = -1  # its row of the penalty table (worker_proc/penalties.py), if any
    # Its sleeping grammar's first mask ([words] int32, on the device), on the sampling rank.
    first_mask: torch.Tensor | None = None

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
    """``layout_step`` for one token per sequence: the hot path of steady decoding. What
    only the sequences know is read in a few list comprehensions, each column is converted
    to numpy once, and whole-list comparisons catch the steady states (every row samples;
    every input token is on the device) without a test per row."""
    num_seqs = len(seqs)
    padding = rows - num_seqs
    rows_of = range(num_seqs)
    every_row_samples = [seq.num_tokens - 1 for seq in seqs] == num_computed
    if every_row_samples:
        sample_rows = list(rows_of)
    else:
        sample_rows = [
            r for r, seq, p in zip(rows_of, seqs, num_computed) if p + 1 == seq.num_tokens
        ]
    # Rows whose input is the newest token, still on the device (it must be one that samples).
    on_host = [len(seq.token_ids) for seq in seqs]
    every_row_pending = on_host == num_computed
    if every_row_pending:
        pending_rows = list(rows_of)
    else:
        pending_rows = [r for r, num, p in zip(rows_of, on_host, num_computed) if p >= num]
    if pending_rows and not every_row_samples:
        sampling = set(sample_rows)
        for row in pending_rows:
            if row not in sampling:
                seq = seqs[row]
                raise TokensNotOnHost(f"sequence {seq.seq_id} needs token {num_computed[row]}")

    if every_row_pending:
        input_ids = np.zeros(rows, dtype=np.int64)
    elif not pending_rows:
        input_ids = _i64([seq.token_ids[p] for seq, p in zip(seqs, num_computed)] + [0] * padding)
    else:
        input_ids = _i64(
            [seq.token_ids[p] if p < num else 0 for seq, num, p in zip(seqs, on_host, num_computed)]
            + [0] * padding
        )
    slot_mapping = [
        seq.block_table[p // block_size] * block_size + p % block_size
        for seq, p in zip(seqs, num_computed)
    ]
    positions = _i64(num_computed + [0] * padding)
    row_slots = _i64([seq.slot for seq in seqs] + [scratch_slot] * padding)
    context_lens = (positions + 1).astype(np.int32)  # padding rows: position 0, length 1
    if every_row_samples:  # one token per row: a row's token index is the row
        sample_index = np.arange(num_seqs, dtype=np.int64)
        sample_slot = row_slots[:num_seqs]
        sample_pos = positions[:num_seqs] + 1
    else:
        sample_index = _i64(sample_rows)
        sample_slot = row_slots[sample_index]
        sample_pos = context_lens[sample_index].astype(np.int64)
    if every_row_pending:
        pending_index = np.arange(num_seqs, dtype=np.int64)
        pending_slot = row_slots[:num_seqs]
    else:
        pending_index = _i64(pending_rows)
        pending_slot = row_slots[pending_index]
    max_context_len = max(num_computed) + 1
    return StepLayout(
        num_seqs=num_seqs,
        num_rows=rows,
        max_query_len=1,
        max_context_len=max_context_len,
        max_blocks=-(-max_context_len // block_size),
        sample_rows=sample_rows,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=_i64(slot_mapping + [-1] * padding),
        row_slots=row_slots,
        pending_index=pending_index,
        pending_slot=pending_slot,
        sample_index=sample_index,
        sample_slot=sample_slot,
        sample_pos=sample_pos,
        context_lens=context_lens,
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
