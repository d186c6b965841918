"""Per-sequence state held by a worker, and the flat batch built from it each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pegainfer.protocol import SamplingParams
from worker_proc.forward_context import ForwardContext


@dataclass
class SequenceState:
    """What a worker keeps for one live sequence between steps.

    ``token_ids`` starts as the prompt (plus, for a preempted sequence, what it had
    generated) and grows by the tokens this worker samples; ``block_table`` grows by the
    scheduler's block updates.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    generator: torch.Generator | None
    block_table: list[int] = field(default_factory=list)


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
    seqs: list[SequenceState],
    num_computed: list[int],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
) -> StepBatch:
    """Flatten the step: sequence i contributes tokens ``num_computed[i] : num_computed[i] +
    num_scheduled[i]`` of its known tokens, at those positions. Callers validate first."""
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    block_rows: list[list[int]] = []
    context_lens: list[int] = []
    query_start_loc = [0]
    sample_rows: list[int] = []
    sample_token_index: list[int] = []
    for row, (seq, start, count) in enumerate(zip(seqs, num_computed, num_scheduled)):
        end = start + count
        table = seq.block_table
        input_ids.extend(seq.token_ids[start:end])
        span = range(start, end)
        positions.extend(span)
        slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in span)
        block_rows.append(table[: -(-end // block_size)])
        context_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + count)
        if end == len(seq.token_ids):
            sample_rows.append(row)
            sample_token_index.append(query_start_loc[-1] - 1)

    max_blocks = max(len(r) for r in block_rows)
    padded_tables = [r + [0] * (max_blocks - len(r)) for r in block_rows]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    context = ForwardContext(
        slot_mapping=tensor(slot_mapping, torch.int64),
        block_tables=tensor(padded_tables, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        query_lens=tensor(num_scheduled, torch.int32),
        query_start_loc=tensor(query_start_loc, torch.int32),
        max_query_len=max(num_scheduled),
        max_context_len=max(context_lens),
        num_seqs=len(seqs),
        num_tokens=len(input_ids),
    )
    return StepBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        context=context,
        sample_rows=sample_rows,
        sample_token_index=tensor(sample_token_index, torch.int64),
    )
