"""CUDA graphs for prefill and mixed steps of up to 1,280 tokens: a short prompt, a prompt's
tail after a prefix-cache hit, a prompt beside the running batch's decodes.

Run eagerly, a prefill costs a launch per kernel through every layer from Python: on an
H200's host about 15 ms of launches at 16 tokens and 19 ms at 128 to 1,024 (Qwen3-4B), against
2 ms of GPU work at a few tokens and about 12 ms at 1,024. Until the GPU work outgrows the
launches (about 1.3k tokens there) a graph is faster even with the padding. So batches of at
most ``max(token_sizes)`` tokens are padded up to the next captured token count and replayed,
exactly as decode batches are (worker_proc/cuda_graphs.py), only with the prefill attention
path: each graph is captured with ``max_query_len`` equal to its token count and room for
``seq_capacity(tokens)`` sequences, and its attention takes its work from a table built on
the device from the batch's real query lengths (kernels/prefill_attention.py), so one graph
serves any batch of at most that many tokens and sequences. Its split over keys is planned
for one sequence with a context as long as the model's, so a lone tail over a long cached
prefix spreads over the whole GPU (a split past a sequence's context exits at once).

Sequence room: graphs from ``MIXED_FROM_TOKENS`` tokens hold ``max_seqs`` sequences (64),
enough for a prompt beside a serving batch's decodes; smaller ones hold
``SMALL_GRAPH_SEQS``, since every sequence of room adds work items (programs that exit at
once, times the many key splits a small graph plans) to every layer's attention. A batch of
few tokens in many sequences takes the smallest graph with room for it.

Padding: tokens past the batch read id 0 at position 0, write no KV (slot -1) and belong to
no sequence (``query_start_loc`` stays at the real token count), so attention skips them;
sequences past the batch have no queries and no context. The graph computes logits only
for ``sample_index`` (one row per sequence slot, padded with row 0).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker_proc.cuda_graphs import GraphBackend, Replay, pick_size
from worker_proc.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)

# Steps of 128 past 512, so that padding costs at most a quarter of a prompt's GEMM work.
TOKEN_SIZES = (32, 64, 128, 256, 512, 640, 768, 896, 1024, 1152, 1280)
MAX_SEQS = 64
SMALL_GRAPH_SEQS = 4
MIXED_FROM_TOKENS = 512


def prefill_token_sizes(max_num_batched_tokens: int) -> list[int]:
    return [size for size in TOKEN_SIZES if size <= max_num_batched_tokens]


class PrefillGraphs:
    """Static prefill inputs and one captured replay per padded token count."""

    def __init__(
        self,
        token_sizes: list[int],
        max_seqs: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        logits_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.token_sizes = sorted(token_sizes)
        self.max_seqs = max_seqs
        self.seq_room = {
            size: max_seqs if size >= MIXED_FROM_TOKENS else min(SMALL_GRAPH_SEQS, max_seqs)
            for size in self.token_sizes
        }
        self.max_model_len = max_model_len
        tokens = self.token_sizes[-1]
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            (max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device
        )
        self.sample_index = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.logits = torch.empty((max_seqs, vocab_size), dtype=logits_dtype, device=device)
        self._replays: dict[int, Replay] = {}

    def context(self, tokens: int) -> ForwardContext:
        seqs = self.seq_room[tokens]
        return ForwardContext(
            slot_mapping=self.slot_mapping[:tokens],
            block_tables=self.block_tables[:seqs],
            context_lens=self.context_lens[:seqs],
            query_lens=self.query_lens[:seqs],
            query_start_loc=self.query_start_loc[: seqs + 1],
            max_query_len=tokens,
            max_context_len=self.max_model_len,
            num_seqs=seqs,
            num_tokens=tokens,
            split_seqs=1,
        )

    def capture(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        compute_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        backend: GraphBackend,
    ) -> float:
        """Capture ``compute_logits(forward(ids, positions)[sample_index], out)`` at every
        token count, largest first, ``out`` the shared logits buffer; returns the seconds it
        took."""
        started = time.monotonic()
        self._reset_padding(0, 0)
        for tokens in sorted(self.token_sizes, reverse=True):
            context = self.context(tokens)
            input_ids, positions = self.input_ids[:tokens], self.positions[:tokens]

            def run(context=context, input_ids=input_ids, positions=positions) -> torch.Tensor:
                with set_forward_context(context):
                    hidden = forward(input_ids, positions)
                seqs = context.num_seqs
                rows = hidden.index_select(0, self.sample_index[:seqs])
                out = self.logits[:seqs]
                computed = compute_logits(rows, out)
                if computed is not out:
                    out.copy_(computed)
                return self.logits

            self._replays[tokens] = backend.capture(run)
        elapsed = time.monotonic() - started
        if not getattr(backend, "records", True):  # a compile-only pass (graph_capture.py)
            return elapsed
        logger.info(
            "captured %d prefill graphs in %.2f s, up to %d tokens in %d sequences "
            "(%d below %d tokens)",
            len(self.token_sizes),
            elapsed,
            self.token_sizes[-1],
            self.max_seqs,
            min(SMALL_GRAPH_SEQS, self.max_seqs),
            MIXED_FROM_TOKENS,
        )
        return elapsed

    def size_for(self, num_seqs: int, num_tokens: int) -> int | None:
        """The graph that runs this prefill batch, or None when it must run eagerly."""
        if not self._replays or num_seqs > self.max_seqs:
            return None
        size = pick_size(num_tokens, self.token_sizes)
        while size is not None and self.seq_room[size] < num_seqs:
            size = pick_size(size + 1, self.token_sizes)
        return size

    def _reset_padding(self, num_tokens: int, num_seqs: int) -> None:
        self.input_ids[num_tokens:].zero_()
        self.positions[num_tokens:].zero_()
        self.slot_mapping[num_tokens:].fill_(-1)
        self.context_lens[num_seqs:].zero_()
        self.query_lens[num_seqs:].zero_()
        self.query_start_loc[num_seqs + 1 :].fill_(num_tokens)
        self.sample_index[num_seqs:].zero_()

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        query_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        slot_block_tables: torch.Tensor,
        row_slots: torch.Tensor,
        sample_index: torch.Tensor,
    ) -> None:
        """Fill the static buffers with one unpadded batch (its tensors on the device); each
        sequence's block table row is gathered from the persistent per-slot table."""
        num_tokens, num_seqs = input_ids.shape[0], context_lens.shape[0]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slot_mapping[:num_tokens].copy_(slot_mapping)
        self.context_lens[:num_seqs].copy_(context_lens)
        self.query_lens[:num_seqs].copy_(query_lens)
        self.query_start_loc[: num_seqs + 1].copy_(query_start_loc)
        torch.index_select(slot_block_tables, 0, row_slots, out=self.block_tables[:num_seqs])
        self._reset_padding(num_tokens, num_seqs)
        self.sample_index.zero_()
        self.sample_index[: sample_index.shape[0]].copy_(sample_index)

    def replay(self, tokens: int) -> torch.Tensor:
        """Logits ``[max_seqs, vocab]``, row i for ``sample_index[i]`` (the graph's sequence
        room of them); valid until the next replay."""
        return self._replays[tokens]()
