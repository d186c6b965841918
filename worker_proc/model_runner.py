"""One worker rank's model, KV cache and sequence state, driven by step plans.

``execute`` applies a plan's diffs (finished sequences, new sequences, new blocks), runs the
flat batch through the model under a forward context, samples a token for every sequence
that reached the end of its known tokens, and appends it there: the worker feeds its own
sampled tokens back as the next decode inputs, so the scheduler never resends them.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from pegainfer.config import EngineConfig
from pegainfer.protocol import (
    NewSequence,
    SamplingParams,
    StepPlan,
    StepResult,
    pack_ids,
    unpack_ids,
)
from worker_proc.batch import SequenceState, StepBatch, build_batch
from worker_proc.forward_context import set_forward_context
from worker_proc.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    check_capacity,
    default_cpu_kv_bytes,
    log_kv_cache,
    profiled_kv_bytes,
)
from worker_proc.layers.attention import Attention, bind_kv_caches
from worker_proc.loader import load_model
from worker_proc.model_config import load_model_config
from worker_proc.parallel_state import init_distributed
from worker_proc.sampler import Sampler, has_penalties

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


class PlanError(ValueError):
    """A step plan inconsistent with the worker's state: a scheduler bug, never retried."""


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """This rank's device. "auto": cuda:{rank} when CUDA is there, else cpu; "cuda":
    cuda:{rank}; "cuda:N": cuda:{N + rank} (the ranks take consecutive GPUs from N)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} was asked for, but CUDA is not available")
        first = int(device.split(":", 1)[1]) if ":" in device else 0
        return torch.device("cuda", first + rank)
    raise ValueError(f"unknown device {device!r} (auto, cpu, cuda or cuda:N)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = _DTYPES.get(dtype)
    if resolved is None:
        raise ValueError(f"unknown dtype {dtype!r} (auto, float32, bfloat16 or float16)")
    return resolved


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device, rank)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_distributed(config, rank, self.device)

        started = time.monotonic()
        self.model_config = load_model_config(config.model_path)
        with torch.inference_mode():
            self.model = load_model(
                self.model_config, config.model_path, self.device, self.dtype, config.max_model_len
            )
        self.load_seconds = time.monotonic() - started

        attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.kv_spec = KVCacheSpec(
            num_layers=len(attention_layers),
            num_kv_heads=attention_layers[0].num_kv_heads,
            head_dim=attention_layers[0].head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
        )
        self.num_kv_blocks = self._decide_num_blocks()
        check_capacity(self.num_kv_blocks, self.block_size, config.max_model_len)
        self.kv_storage, kv_caches = allocate_kv_cache(
            self.kv_spec, self.num_kv_blocks, self.device
        )
        bind_kv_caches(self.model, kv_caches)
        log_kv_cache(self.kv_spec, self.num_kv_blocks, self.device)

        self.sampler = Sampler(self.device, config.seed)
        self.seqs: dict[int, SequenceState] = {}

    # ------------------------------------------------------------------ KV cache sizing

    def _decide_num_blocks(self) -> int:
        if self.config.kv_cache_memory > 0:
            kv_bytes = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            kv_bytes = self._profile_kv_bytes()
        else:
            kv_bytes = default_cpu_kv_bytes(self.config, self.kv_spec)
        return max(kv_bytes // self.kv_spec.bytes_per_block, 0)

    @torch.inference_mode()
    def _profile_kv_bytes(self) -> int:
        """Run the largest batch the scheduler may send and see how much memory is left."""
        config = self.config
        lengths, remaining = [], config.max_num_batched_tokens
        while remaining > 0 and len(lengths) < config.max_num_seqs:
            lengths.append(min(remaining, config.max_model_len))
            remaining -= lengths[-1]
        temp_blocks = sum(self.kv_spec.blocks_for_tokens(n) for n in lengths)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        temp_storage, temp_caches = allocate_kv_cache(self.kv_spec, temp_blocks, self.device)
        bind_kv_caches(self.model, temp_caches)
        seqs, next_block = [], 0
        for i, n in enumerate(lengths):
            count = self.kv_spec.blocks_for_tokens(n)
            table = list(range(next_block, next_block + count))
            next_block += count
            seqs.append(SequenceState(-1 - i, [0] * n, n, SamplingParams(), None, table))
        batch = build_batch(seqs, [0] * len(seqs), lengths, self.block_size, self.device)
        hidden = self._forward(batch)
        # The logits of a full decode batch are the other large transient.
        rows = min(config.max_num_seqs, hidden.shape[0])
        self.model.compute_logits(hidden[:rows]).float().softmax(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - temp_storage.nbytes
        del temp_storage, temp_caches, hidden, batch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        kv_bytes = profiled_kv_bytes(config.gpu_memory_utilization, total, peak, outside_torch)
        logger.info(
            "profile: peak %.2f GiB at %d tokens, %.2f GiB held outside torch, %.2f GiB total "
            "-> %.2f GiB for the KV cache",
            peak / 2**30,
            sum(lengths),
            outside_torch / 2**30,
            total / 2**30,
            kv_bytes / 2**30,
        )
        return kv_bytes

    # ------------------------------------------------------------------ plans

    def _add_sequence(self, new: NewSequence) -> None:
        if new.seq_id in self.seqs:
            raise PlanError(f"new sequence {new.seq_id} is already live")
        token_ids = unpack_ids(new.token_ids)
        if not token_ids:
            raise PlanError(f"new sequence {new.seq_id} has no tokens")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise PlanError(f"sequence {new.seq_id} has token ids outside [0, {vocab})")
        self.seqs[new.seq_id] = SequenceState(
            seq_id=new.seq_id,
            token_ids=token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
            sampling=new.sampling,
            generator=self.sampler.make_generator(new.sampling),
        )

    def _append_blocks(self, seq_id: int, block_ids: list[int]) -> None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise PlanError(f"block update for unknown sequence {seq_id}")
        if block_ids and (min(block_ids) < 0 or max(block_ids) >= self.num_kv_blocks):
            raise PlanError(
                f"sequence {seq_id}: block ids outside [0, {self.num_kv_blocks}): {block_ids}"
            )
        seq.block_table.extend(block_ids)

    def _validate(
        self, seq_ids: list[int], num_computed: list[int], num_scheduled: list[int]
    ) -> list[SequenceState]:
        if not len(seq_ids) == len(num_computed) == len(num_scheduled):
            raise PlanError(
                f"plan arrays differ in length: {len(seq_ids)} seq ids, "
                f"{len(num_computed)} num_computed, {len(num_scheduled)} num_scheduled"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise PlanError("a sequence appears twice in one step")
        seqs = []
        for seq_id, computed, scheduled in zip(seq_ids, num_computed, num_scheduled):
            seq = self.seqs.get(seq_id)
            if seq is None:
                raise PlanError(f"step schedules unknown sequence {seq_id}")
            if computed < 0 or scheduled <= 0:
                raise PlanError(
                    f"sequence {seq_id}: num_computed {computed}, num_scheduled {scheduled}"
                )
            end = computed + scheduled
            if end > len(seq.token_ids):
                raise PlanError(
                    f"sequence {seq_id}: num_computed {computed} + num_scheduled {scheduled} "
                    f"exceeds its {len(seq.token_ids)} known tokens"
                )
            if end > len(seq.block_table) * self.block_size:
                raise PlanError(
                    f"sequence {seq_id}: {end} tokens need "
                    f"{-(-end // self.block_size)} blocks, it has {len(seq.block_table)}"
                )
            seqs.append(seq)
        return seqs

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        for seq_id in unpack_ids(plan.finished_seq_ids):
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self._add_sequence(new)
        for update in plan.block_updates:
            self._append_blocks(update.seq_id, unpack_ids(update.block_ids))
        seq_ids = unpack_ids(plan.seq_ids)
        if not seq_ids:
            return StepResult(step_id=plan.step_id, seq_ids=b"", token_ids=b"")
        num_computed = unpack_ids(plan.num_computed)
        num_scheduled = unpack_ids(plan.num_scheduled)
        seqs = self._validate(seq_ids, num_computed, num_scheduled)

        batch = build_batch(seqs, num_computed, num_scheduled, self.block_size, self.device)
        if not batch.sample_rows:
            self._forward(batch)
            return StepResult(step_id=plan.step_id, seq_ids=b"", token_ids=b"")
        hidden = self._forward(batch)
        logits = self.model.compute_logits(hidden[batch.sample_token_index]).float()
        sampling_seqs = [seqs[row] for row in batch.sample_rows]
        params = [s.sampling for s in sampling_seqs]
        histories = None
        if any(has_penalties(p) for p in params):
            histories = [(s.token_ids, s.num_prompt_tokens) for s in sampling_seqs]
        generators = [s.generator for s in sampling_seqs]
        tokens = self.sampler.sample(logits, params, generators, histories).tolist()
        for seq, token in zip(sampling_seqs, tokens):
            seq.token_ids.append(token)
        return StepResult(
            step_id=plan.step_id,
            seq_ids=pack_ids([s.seq_id for s in sampling_seqs]),
            token_ids=pack_ids(tokens),
        )

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
        seq = SequenceState(-1, list(token_ids), len(token_ids), SamplingParams(), None, table)
        batch = build_batch([seq], [0], [len(token_ids)], self.block_size, self.device)
        return self.model.compute_logits(self._forward(batch)).float()
