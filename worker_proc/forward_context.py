"""Per-step metadata that the attention layers read.

The model runner builds one ``ForwardContext`` per step and installs it for the duration of
the forward pass, so that forward() signatures carry only hidden states and positions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    """Flat (varlen) batch of ``num_seqs`` sequences and ``num_tokens`` tokens.

    slot_mapping:     [num_tokens] int64, the KV slot each new token writes (-1: padding)
    block_tables:     [num_seqs, max_blocks] int32, padded with 0
    context_lens:     [num_seqs] int32, tokens in the cache after this step (incl. new ones)
    query_lens:       [num_seqs] int32, new tokens of each sequence this step
    query_start_loc:  [num_seqs + 1] int32, prefix sums of query_lens

    ``split_seqs``: how many sequences prefill attention plans its split over keys for;
    0 means ``num_seqs``. A captured prefill graph has room for several sequences but
    mostly replays one (a prompt's tail after a prefix-cache hit), which alone must fill
    the GPU.

    ``prefill_work``: prefill attention's work table for this batch
    (``kernels.prefill_work_table``), built on the device by the first attention layer of a
    forward and read by the others; ``set_forward_context`` clears it, so that a captured
    graph records its construction instead of reusing a warm-up run's.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_context_len: int
    num_seqs: int
    num_tokens: int
    split_seqs: int = 0
    prefill_work: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    ctx.prefill_work = None
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: run the model under set_forward_context")
    return _current
