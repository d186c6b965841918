"""One worker rank's model, KV cache and sequence state, driven by step plans.

``submit(plan)`` applies a plan's diffs (finished sequences, new sequences, new blocks),
launches the step (a captured CUDA graph for a pure-decode batch, or for a prefill or mixed
batch of up to 1,280 tokens; eager otherwise), samples a token for every sequence that reached the end of its known tokens,
and queues the tokens' asynchronous copy to the host; it returns without waiting for the device. The worker feeds
its own sampled tokens back as the next decode inputs, from a per-sequence device slot, so
the next plan can be launched before this one's tokens are on the host (overlapped
scheduling). ``poll_results`` hands back the finished steps' results in order. ``execute``
is the synchronous composition of the two.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

import torch

from kernels.backend import warm_up_triton
from pegainfer.config import EngineConfig
from pegainfer.multinode import local_rank
from pegainfer.protocol import (
    StepPlan,
    StepResult,
    unpack_ids,
)
from pegainfer.startup_timeline import StartupTimeline
from worker_proc.batch import (
    SequenceState,
    StepBatch,
    StepLayout,
    TokensNotOnHost,
    build_batch,
    layout_step,
)
from worker_proc.cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphBackend
from worker_proc.device_choice import resolve_device, resolve_dtype
from worker_proc.forward_context import ForwardContext, set_forward_context
from worker_proc.graph_capture import (
    KernelCompile,
    capture_graphs,
    release_warm_up_memory,
)
from worker_proc.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    check_capacity,
    log_kv_cache,
)
from worker_proc.kv_profile import decide_num_blocks
from worker_proc.layers.attention import bind_kv_caches
from worker_proc.live_seqs import LiveSequences
from worker_proc.live_seqs import PlanError as PlanError  # re-exported for callers
from worker_proc.loader import load_model
from worker_proc.logit_edits import StopMasks
from worker_proc.logprobs import LogprobsCollector, wants_prompt_hidden
from worker_proc.model_config import load_model_config
from worker_proc.parallel_state import init_distributed
from worker_proc.penalties import PenaltyTable
from worker_proc.prefill_graphs import PrefillGraphs
from worker_proc.sampler import Sampler, SamplingBatch
from worker_proc.seq_slots import SlotTable
from worker_proc.step_draw import StepDraw
from worker_proc.step_results import ResultQueue
from worker_proc.upload import Uploader
from worker_proc.warm_up import warm_up_step_path

logger = logging.getLogger(__name__)


class ModelRunner(StepDraw):
    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        graph_backend: GraphBackend | None = None,
        timeline: StartupTimeline | None = None,
    ) -> None:
        """``graph_backend``: how decode graphs are captured; default: CUDA graphs on a GPU
        unless ``config.enforce_eager``, none on the CPU (tests pass a stand-in).
        ``timeline``: where the start-up phases are marked (the worker logs it)."""
        self.timeline = timeline = timeline or StartupTimeline(first_phase=None)
        self.config = config
        self.rank = rank
        # On node k > 0 the ranks take the node's own GPUs from 0 (pegainfer/multinode.py).
        self.device = resolve_device(config.device, local_rank(config, rank))
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.init()  # the context's creation counts as its own phase
            torch.empty(1, device=self.device)
        init_distributed(config, rank, self.device)
        timeline.mark("device")

        started = time.monotonic()
        self.model_config = load_model_config(config.model_path, config.hf_overrides)
        # Triton's import and cache key take most of a second, and the weights' load leaves
        # the CPU waiting on reads and copies: let the two overlap.
        triton_warm_up = None
        if self.device.type == "cuda":
            triton_warm_up = threading.Thread(target=warm_up_triton, name="triton-warm-up")
            triton_warm_up.start()
        with torch.inference_mode():
            self.model = load_model(
                self.model_config, config.model_path, self.device, self.dtype, config.max_model_len
            )
        self.load_seconds = time.monotonic() - started
        if triton_warm_up is not None:
            triton_warm_up.join()
        timeline.mark("weights")

        self.kv_spec = KVCacheSpec.for_model(self.model, self.block_size, self.dtype)
        self.max_blocks_per_seq = self.kv_spec.blocks_for_tokens(config.max_model_len)
        if graph_backend is None and self.device.type == "cuda" and not config.enforce_eager:
            graph_backend = CudaGraphBackend(self.device)
        capture_args = (
            self.model,
            config,
            self.model_config.vocab_size,
            self.max_blocks_per_seq,
            self.dtype,
            self.device,
        )
        kernel_compile = KernelCompile(capture_args, timeline)
        self.num_kv_blocks = decide_num_blocks(
            config,
            self.kv_spec,
            self.model,
            self.device,
            self._forward,
            kernel_compile.with_profile if isinstance(graph_backend, CudaGraphBackend) else None,
        )
        timeline.mark("kv profile")
        check_capacity(self.num_kv_blocks, self.block_size, config.max_model_len)
        self.kv_storage, kv_caches = allocate_kv_cache(
            self.kv_spec, self.num_kv_blocks, self.device
        )
        bind_kv_caches(self.model, kv_caches)
        log_kv_cache(self.kv_spec, self.num_kv_blocks, self.device)

        self.slots = SlotTable(max(config.max_num_seqs, 1), self.max_blocks_per_seq, self.device)
        self.uploader = Uploader(self.device)
        # Only rank 0 samples, so only it counts the penalised sequences' tokens.
        self.penalties = (
            PenaltyTable(self.model_config.vocab_size, self.device, self.uploader)
            if rank == 0
            else None
        )
        self.live = LiveSequences(
            self.slots,
            self.uploader,
            self.model_config.vocab_size,
            self.num_kv_blocks,
            self.block_size,
            self.penalties,
            samples=rank == 0,
        )
        self.seqs = self.live.seqs  # seq_id -> SequenceState
        self.sampler = Sampler(self.device, config.seed, self.uploader)
        eos_token_ids = config.model.eos_token_ids if config.model is not None else []
        self.stop_masks = StopMasks(eos_token_ids, self.uploader)
        self.results = ResultQueue(self.device)
        # Only for sequences that ask.
        self.logprobs = LogprobsCollector(self.model_config.vocab_size)
        self._sampling_cache: tuple[tuple[int, ...], SamplingBatch] | None = None
        self._early_results: list[StepResult] = []  # copied back ahead of poll_results
        # A step whose forward pass is queued and whose draw waits for its grammar masks:
        # (step id, its masked seq ids, the draw).
        self._awaiting_masks: tuple[int, bytes, Callable[[bytes, bytes], None]] | None = None
        timeline.mark("kv cache")

        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graph_capture_seconds = 0.0
        if isinstance(graph_backend, CudaGraphBackend):
            kernel_compile.graphs_alone()
        if graph_backend is not None:
            captured = capture_graphs(*capture_args, graph_backend)
            self.graphs, self.prefill_graphs = captured.decode, captured.prefill
            self.graph_capture_seconds = captured.seconds
            release_warm_up_memory(self.device)
        timeline.mark("graphs")
        # The eager ops that only requests run load their CUDA modules here, not inside the
        # first requests (worker_proc/warm_up.py). A CPU has no lazy loading to hide.
        if self.device.type == "cuda":
            warm_up_step_path(self)
            timeline.mark("warm-up")

    # ------------------------------------------------------------------ plans

    def _copy_back_all(self) -> None:
        """Wait for every queued step's tokens (kept for ``poll_results``)."""
        self._early_results.extend(self.results.poll(wait=True))

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> None:
        """Launch one step; its result comes out of ``poll_results`` in step order."""
        if self._awaiting_masks is not None:
            raise PlanError(
                f"step {plan.step_id} arrived while step {self._awaiting_masks[0]} waits for "
                "its token masks"
            )
        self.live.apply_diffs(plan)
        seq_ids = unpack_ids(plan.seq_ids)
        if not seq_ids:
            self.results.push(plan.step_id, [], None)
            return
        num_computed = unpack_ids(plan.num_computed)
        num_scheduled = unpack_ids(plan.num_scheduled)
        seqs = self.live.batch(seq_ids, num_computed, num_scheduled)
        size = prefill_size = None
        # Prompt logprobs need the hidden states: a step computing a prompt that asks for
        # them runs eagerly. The sequence's later steps (its decodes) replay graphs again.
        if self.graphs is not None and not any(
            wants_prompt_hidden(s, c) for s, c in zip(seqs, num_computed, strict=True)
        ):
            size = self.graphs.size_for(len(seqs), max(num_scheduled))
            if size is None and self.prefill_graphs is not None:
                prefill_size = self.prefill_graphs.size_for(len(seqs), sum(num_scheduled))
        args = (seqs, num_computed, num_scheduled, self.block_size, size, self.slots.scratch_slot)
        try:
            layout = layout_step(*args)
        except TokensNotOnHost:
            self._copy_back_all()
            layout = layout_step(*args)
        self._run(plan.step_id, seqs, layout, size, prefill_size, plan)

    def _run(
        self,
        step_id: int,
        seqs: list[SequenceState],
        layout: StepLayout,
        size: int | None,
        prefill_size: int | None = None,
        plan: StepPlan | None = None,
    ) -> None:
        (
            input_ids,
            positions,
            slot_mapping,
            row_slots,
            pending_index,
            pending_slot,
            sample_index,
            sample_slot,
            sample_pos,
            context_lens,
            query_lens,
            query_start_loc,
        ) = self.uploader.upload(layout.arrays())
        last_token = self.slots.last_token
        greedy_tokens = None  # each sampling row's argmax, where a decode graph took it
        if size is not None:
            graphs = self.graphs
            assert graphs is not None
            graphs.load(
                size,
                input_ids,
                positions,
                slot_mapping,
                context_lens,
                self.slots.block_tables,
                row_slots,
                layout.max_blocks,
                last_token,
                pending_index,
                pending_slot,
            )
            if not layout.sample_rows:
                graphs.replay(size)
                self.results.push(step_id, [], None)
                return
            logits, greedy_tokens = graphs.replay(size), graphs.greedy_tokens
            count = len(layout.sample_rows)
            if layout.sample_rows[-1] == count - 1:  # rows 0 .. count - 1 (they ascend)
                logits, greedy_tokens = logits[:count], greedy_tokens[:count]
            else:
                logits = logits.index_select(0, sample_index)
                greedy_tokens = greedy_tokens.index_select(0, sample_index)
        elif prefill_size is not None:
            prefill = self.prefill_graphs
            assert prefill is not None
            if len(layout.pending_index):
                input_ids.index_copy_(0, pending_index, last_token.index_select(0, pending_slot))
            prefill.load(
                input_ids,
                positions,
                slot_mapping,
                context_lens,
                query_lens,
                query_start_loc,
                self.slots.block_tables,
                row_slots,
                sample_index,
            )
            logits = prefill.replay(prefill_size)[: len(layout.sample_rows)]
            if not layout.sample_rows:
                self.results.push(step_id, [], None)
                return
        else:
            if len(layout.pending_index):
                input_ids.index_copy_(0, pending_index, last_token.index_select(0, pending_slot))
            block_tables = self.slots.block_tables[:, : layout.max_blocks].index_select(
                0, row_slots
            )
            context = ForwardContext(
                slot_mapping=slot_mapping,
                block_tables=block_tables,
                context_lens=context_lens,
                query_lens=query_lens,
                query_start_loc=query_start_loc,
                max_query_len=layout.max_query_len,
                max_context_len=layout.max_context_len,
                num_seqs=layout.num_rows,
                num_tokens=layout.num_tokens,
            )
            with set_forward_context(context):
                hidden = self.model(input_ids, positions)
            # On every rank: compute_logits all-gathers over the tensor-parallel ranks.
            self.logprobs.prompt_step(step_id, hidden, seqs, layout, self.model.compute_logits)
            if not layout.sample_rows:
                self.results.push(step_id, [], None)
                return
            logits = self.model.compute_logits(hidden.index_select(0, sample_index))

        samplers = [seqs[row] for row in layout.sample_rows]
        sample = functools.partial(
            self._sample, step_id, logits, greedy_tokens, samplers, sample_pos, sample_slot, plan
        )
        if plan is not None and plan.masks_follow and self.rank == 0:
            # The forward pass is queued; the draw waits for the step's grammar masks.
            self._awaiting_masks = (step_id, plan.masked_seq_ids, sample)
            return
        if plan is None:
            sample(b"", b"")
        else:
            sample(plan.masked_seq_ids, plan.token_bitmask)

    def has_pending(self) -> bool:
        return (
            bool(self._early_results) or len(self.results) > 0 or self._awaiting_masks is not None
        )

    @property
    def awaits_masks(self) -> bool:
        return self._awaiting_masks is not None

    def waits_only_for_masks(self) -> bool:
        """A step waits for its masks, and no result is left to send."""
        return (
            self._awaiting_masks is not None and not self._early_results and len(self.results) == 0
        )

    @property
    def oldest_pending_step_id(self) -> int | None:
        if self._early_results:
            return self._early_results[0].step_id
        if self.results.oldest_step_id is None and self._awaiting_masks is not None:
            return self._awaiting_masks[0]
        return self.results.oldest_step_id

    def poll_results(self, wait: bool = False) -> list[StepResult]:
        """Results of the submitted steps whose tokens are on the host, in step order;
        with ``wait``, of all of them."""
        ready, self._early_results = self._early_results, []
        return self.logprobs.attach(ready + self.results.poll(wait))

    def execute(self, plan: StepPlan) -> StepResult:
        """Submit one plan and wait for its result (nothing else may be in flight)."""
        if self.has_pending():
            raise RuntimeError("execute() needs an idle runner; use submit and poll_results")
        self.submit(plan)
        (result,) = self.poll_results(wait=True)
        return result

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        with set_forward_context(batch.context):
            return self.model(batch.input_ids, batch.positions)

    # ------------------------------------------------------------------ testing aids

    @torch.inference_mode()
    def prefill_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[len(token_ids), vocab]`` for every position of one sequence,
        through the same paged path as serving. It borrows KV blocks that no live sequence
        holds and keeps no state afterwards."""
        if not token_ids:
            raise ValueError("prefill_logits needs at least one token")
        needed = self.kv_spec.blocks_for_tokens(len(token_ids))
        in_use = {block for seq in self.seqs.values() for block in seq.block_table}
        # Lazily: a profiled GPU cache can have millions of blocks.
        free = (block for block in range(self.num_kv_blocks) if block not in in_use)
        table = list(itertools.islice(free, needed))
        if len(table) < needed:
            raise RuntimeError(
                f"{len(token_ids)} tokens need {needed} free KV blocks, {len(table)} are free"
            )
        batch = build_batch(
            [list(token_ids)], [table], [0], [len(token_ids)], self.block_size, self.device
        )
        return self.model.compute_logits(self._forward(batch)).float()
