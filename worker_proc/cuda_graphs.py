"""CUDA-graph decode: the model forward plus the logits, captured per batch size.

A pure-decode batch (one new token per sequence) is padded up to the next captured size and
replayed from static input buffers: launching the whole forward costs one graph launch
instead of hundreds of kernel launches. Prefills and mixed batches of up to 1,280 tokens
have graphs of their own (worker_proc/prefill_graphs.py); larger ones run eagerly.

Sizes: 1, 2, 4, 8, then every 8 up to 64, every 16 up to 256 and every 32 beyond, up to
``max_num_seqs`` (always captured itself), captured largest first into one shared memory
pool, so the smaller graphs reuse the largest one's memory.

Padding rows read token 0 at position 0, write no KV (slot -1), and attend over one
position of the scratch block table row (context length 1); their logits are discarded.
Attention is captured with ``max_query_len = 1`` and ``max_context_len = max_model_len``,
so that a split-KV kernel sizes its grid and workspace for the longest context any replay
can see.

The capture mechanism is a small ``GraphBackend``: ``CudaGraphBackend`` captures real CUDA
graphs; ``EagerGraphBackend`` (for tests on the CPU) "replays" by calling the function again
over the same static buffers, which exercises bucket choice, padding and buffer filling.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

import kernels
from kernels.decode_inputs import load_decode_inputs
from worker_proc.forward_context import ForwardContext, set_forward_context

logger = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending; the largest is ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError("max_num_seqs must be at least 1")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, 257, 16), *range(288, max_num_seqs + 1, 32)]
    sizes = sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})
    return sizes


def pick_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds ``num_seqs`` rows; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        """Record ``fn`` (which reads and writes only static buffers); the returned callable
        replays it and returns its output tensor."""
        ...


class CudaGraphBackend:
    """Real CUDA graphs, all in one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        # One eager run first: lazy initialisation (cuBLAS workspaces, Triton compilation
        # and autotuning) must not happen inside the capture.
        fn()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # Not torch.cuda.graph(), which empties the allocator's cache before every capture:
        # each warm-up run would then allocate its activations from the driver again. Sizes
        # are captured largest first, so one warm-up's cached blocks serve the next.
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                output = fn()
            except BaseException:
                with contextlib.suppress(Exception):  # the first error is the one to see
                    graph.capture_end()
                raise
            graph.capture_end()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class EagerGraphBackend:
    """A stand-in for tests without a GPU: replay re-runs the function."""

    def __init__(self) -> None:
        self.num_captures = 0
        self.num_replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        fn()
        self.num_captures += 1

        def replay() -> torch.Tensor:
            self.num_replays += 1
            return fn()

        return replay


class DecodeGraphs:
    """Static decode inputs and one captured replay per batch size."""

    def __init__(
        self,
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        logits_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.max_model_len = max_model_len
        n = self.max_size
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_seq), dtype=torch.int32, device=device)
        # Every graph writes its logits here (the LM head's own output on one rank, a copy
        # on several), so one logits buffer stays allocated instead of one per size in the
        # pool (at a 150k vocabulary those add up to most of a GiB).
        self.logits = torch.empty((n, vocab_size), dtype=logits_dtype, device=device)
        # Each row's argmax, taken inside the graph right after the LM head: a greedy batch
        # then launches no sampling kernel of its own (worker_proc/model_runner.py).
        self.greedy_tokens = torch.zeros(n, dtype=torch.int64, device=device)
        self._replays: dict[int, Replay] = {}

    def context(self, size: int) -> ForwardContext:
        return ForwardContext(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            query_lens=self.query_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_context_len=self.max_model_len,
            num_seqs=size,
            num_tokens=size,
        )

    def capture(
        self,
        forward_logits: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        backend: GraphBackend,
    ) -> float:
        """Capture ``forward_logits(input_ids, positions, out) -> logits`` at every size,
        largest first (logits written into ``out`` where the LM head can, else copied
        there); returns the seconds it took."""
        started = time.monotonic()
        # Padding values everywhere, so the warm-up and capture runs write no KV.
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.block_tables.zero_()
        records = getattr(backend, "records", True)
        if records:
            order = sorted(self.sizes, reverse=True)
        else:
            # A compile-only pass (graph_capture.py) ends when its last variant has compiled,
            # so it meets the kernels that only small batches launch (the one-row GEMV, the
            # input loader) first: met last, they were its last new variants (on an H100 with
            # Triton's cache empty, found 1.94 s into a caught run of 2.26, the pass 4.80 s).
            self._compile_loader()
            order = sorted(self.sizes)
        for size in order:
            context = self.context(size)
            input_ids, positions = self.input_ids[:size], self.positions[:size]

            logits, greedy = self.logits[:size], self.greedy_tokens[:size]

            def run(
                context=context,
                input_ids=input_ids,
                positions=positions,
                logits=logits,
                greedy=greedy,
            ) -> torch.Tensor:
                with set_forward_context(context):
                    computed = forward_logits(input_ids, positions, logits)
                    if computed is not logits:
                        logits.copy_(computed)
                    kernels.argmax_rows(logits, out=greedy)
                return logits

            self._replays[size] = backend.capture(run)
        if not records:
            return time.monotonic() - started
        self._compile_loader()
        elapsed = time.monotonic() - started
        logger.info(
            "captured %d decode graphs in %.2f s, batch sizes %s",
            len(self.sizes),
            elapsed,
            _ranges(self.sizes),
        )
        return elapsed

    def _compile_loader(self) -> None:
        """Run the input loader once on the padding values, so that its kernel is compiled
        at start-up rather than by the first decode step."""
        rows = self.sizes[0]
        static = (
            self.input_ids[:rows],
            self.positions[:rows],
            self.slot_mapping[:rows],
            self.context_lens[:rows],
        )
        none = self.input_ids[:0]
        load_decode_inputs(
            static,
            tuple(t.clone() for t in static),
            self.block_tables[:rows, :1],
            self.block_tables,
            torch.zeros(rows, dtype=torch.int64, device=self.input_ids.device),
            self.input_ids,
            none,
            none,
        )

    def size_for(self, num_seqs: int, max_query_len: int) -> int | None:
        """The graph that runs this batch, or None when it must run eagerly."""
        if max_query_len != 1 or not self._replays:
            return None
        return pick_size(num_seqs, self.sizes)

    def load(
        self,
        size: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        slot_block_tables: torch.Tensor,
        row_slots: torch.Tensor,
        max_blocks: int,
        last_token: torch.Tensor,
        pending_index: torch.Tensor,
        pending_slot: torch.Tensor,
    ) -> None:
        """Fill the static buffers of ``size`` rows (inputs already padded to ``size``) in
        one launch (kernels/decode_inputs.py): each row's block table row is gathered from
        the persistent per-slot table (its first ``max_blocks`` columns, all that attention
        reads at this step's longest context), and the rows ``pending_index`` take their
        token from ``last_token[pending_slot]``."""
        load_decode_inputs(
            (
                self.input_ids[:size],
                self.positions[:size],
                self.slot_mapping[:size],
                self.context_lens[:size],
            ),
            (input_ids, positions, slot_mapping, context_lens),
            self.block_tables[:size, :max_blocks],
            slot_block_tables,
            row_slots,
            last_token,
            pending_index,
            pending_slot,
        )

    def replay(self, size: int) -> torch.Tensor:
        """Logits ``[size, vocab]`` of the loaded batch; valid until the next replay, as is
        ``greedy_tokens[:size]``, their argmax."""
        return self._replays[size]()


def _ranges(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return ", ".join(map(str, sizes))
    return f"{', '.join(map(str, sizes[:5]))}, ..., {sizes[-1]}"
