"""Shared by the worker tests: tiny random HF checkpoints, engine configs, and a minimal
scheduler stand-in that drives ModelRunner with step plans."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field

import torch

from pegainfer.config import EngineConfig, finalize, read_model_info
from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    SamplingParams,
    StepPlan,
    pack_ids,
)

TINY_SIZES = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    # Default init (std 0.02) gives near-uniform logits and ties in greedy decoding.
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)

# Three layers, the middle one dense, of eight experts with two a token.
TINY_MOE = dict(
    num_hidden_layers=3,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
)


def make_tiny_checkpoint(path: str, family: str, seed: int = 0, **overrides) -> str:
    """Write a random ``family`` ("qwen3", "qwen3_moe" or "llama") checkpoint in several
    safetensors shards plus an index, with non-trivial norm weights so their loading is
    exercised."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    config_cls, model_cls = {
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[family]
    sizes = {**TINY_SIZES, **(TINY_MOE if family == "qwen3_moe" else {})}
    config = config_cls(**{**sizes, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(path, max_shard_size="60KB")
    files = os.listdir(path)
    assert "model.safetensors.index.json" in files, files
    assert sum(f.endswith(".safetensors") for f in files) >= 2, files
    return path


def engine_config(
    model_path: str,
    dtype: str = "float32",
    block_size: int = 4,
    kv_cache_memory: int = 1 << 20,
    max_model_len: int = 128,
    device: str = "cpu",
    **overrides,
) -> EngineConfig:
    config = EngineConfig(
        model_path=model_path,
        served_model_name="x",
        device=device,
        dtype=dtype,
        block_size=block_size,
        kv_cache_memory=kv_cache_memory,
        max_model_len=max_model_len,
        model=read_model_info(model_path),
        **overrides,
    )
    return finalize(config)


@dataclass
class _Seq:
    seq_id: int
    prompt: list[int]
    max_new: int
    sampling: SamplingParams
    num_computed: int = 0
    length: int = 0  # tokens known to the worker
    blocks: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    sent: bool = False


class MiniScheduler:
    """Just enough scheduling to drive a ModelRunner like the real scheduler would:
    chunked prefill mixed with decodes, blocks drawn from a shuffled free list, finished
    sequences reported in the next plan."""

    def __init__(self, runner, chunk: int = 5, token_budget: int = 16, seed: int = 0) -> None:
        self.runner = runner
        self.chunk = chunk
        self.token_budget = token_budget
        # A profiled GPU cache can hold millions of blocks; a few thousand are plenty here.
        self.free_blocks = list(range(min(runner.num_kv_blocks, 4096)))
        random.Random(seed).shuffle(self.free_blocks)
        self.seqs: dict[int, _Seq] = {}
        self.finished: list[int] = []
        self.step_id = 0

    def add(self, seq_id: int, prompt: list[int], max_new: int, sampling: SamplingParams) -> None:
        self.seqs[seq_id] = _Seq(seq_id, list(prompt), max_new, sampling, length=len(prompt))

    def _plan(self) -> tuple[StepPlan, list[_Seq]]:
        block_size = self.runner.block_size
        new_seqs, updates, batch, counts = [], [], [], []
        budget = self.token_budget
        for seq in self.seqs.values():
            if budget <= 0:
                break
            remaining = seq.length - seq.num_computed
            count = min(remaining, self.chunk, budget)
            end = seq.num_computed + count
            needed = -(-end // block_size) - len(seq.blocks)
            new_blocks = [self.free_blocks.pop() for _ in range(max(needed, 0))]
            seq.blocks.extend(new_blocks)
            if not seq.sent:
                new_seqs.append(
                    NewSequence(seq.seq_id, pack_ids(seq.prompt), seq.sampling, len(seq.prompt))
                )
                seq.sent = True
            if new_blocks:
                updates.append(BlockTableUpdate(seq.seq_id, pack_ids(new_blocks)))
            batch.append(seq)
            counts.append(count)
            budget -= count
        plan = StepPlan(
            step_id=self.step_id,
            new_seqs=new_seqs,
            seq_ids=pack_ids([s.seq_id for s in batch]),
            num_computed=pack_ids([s.num_computed for s in batch]),
            num_scheduled=pack_ids(counts),
            block_updates=updates,
            finished_seq_ids=pack_ids(self.finished),
        )
        self.finished = []
        self.step_id += 1
        for seq, count in zip(batch, counts):
            seq.num_computed += count
        return plan, batch

    def flush(self) -> None:
        """Send a plan that only reports the finished sequences."""
        plan = StepPlan(self.step_id, [], b"", b"", b"", [], pack_ids(self.finished))
        self.step_id += 1
        self.finished = []
        result = self.runner.execute(plan)
        assert result.seq_ids == b"" and result.token_ids == b""

    def run(self, max_steps: int = 1000) -> dict[int, list[int]]:
        from pegainfer.protocol import unpack_ids

        outputs: dict[int, list[int]] = {}
        for _ in range(max_steps):
            if not self.seqs:
                break
            plan, _ = self._plan()
            result = self.runner.execute(plan)
            assert result.step_id == plan.step_id and result.error is None
            for seq_id, token in zip(unpack_ids(result.seq_ids), unpack_ids(result.token_ids)):
                seq = self.seqs[seq_id]
                seq.output.append(token)
                seq.length += 1
                if len(seq.output) == seq.max_new:
                    outputs[seq_id] = seq.output
                    self.finished.append(seq_id)
                    self.free_blocks.extend(seq.blocks)
                    del self.seqs[seq_id]
        assert not self.seqs, "sequences left unfinished"
        return outputs


def drive(
    runner,
    requests: list[tuple[str, list[int], SamplingParams]],
    in_flight: int,
    num_kv_blocks: int = 200,
    max_num_batched_tokens: int = 24,
    max_num_seqs: int = 8,
    max_model_len: int = 128,
    block_size: int = 4,
):
    """Serve ``requests`` with the real Scheduler and ``runner``, up to ``in_flight`` steps
    submitted before their results are polled (one batch of polls per round, as the worker
    loop does). Returns (tokens by request id, finish reason by request id, scheduler)."""
    from collections import deque

    from pegainfer.protocol import TokenizedRequest, unpack_ids
    from scheduler_proc.scheduler import Scheduler

    config = engine_config(
        runner.config.model_path,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    config.num_kv_blocks = num_kv_blocks
    scheduler = Scheduler(config)
    for request_id, prompt, sampling in requests:
        rejected = scheduler.add_request(
            TokenizedRequest(request_id, pack_ids(prompt), sampling, 0.0)
        )
        assert rejected is None
    outputs: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    finish: dict[str, str] = {}
    submitted: deque[int] = deque()
    for _ in range(5000):
        scheduler.collect_grammars()
        # A plan may not overtake the token masks owed to one before it.
        while scheduler.num_steps_in_flight < in_flight and not scheduler.constrained.deferred:
            plan = scheduler.schedule()
            if plan is None:
                break
            runner.submit(plan)
            submitted.append(plan.step_id)
        if not submitted and not scheduler.num_compiling:
            break
        for result in runner.poll_results(wait=True):
            assert result.step_id == submitted.popleft() and result.error is None
            for out in scheduler.on_step_result(result):
                outputs[out.request_id].extend(unpack_ids(out.new_token_ids))
                if out.finish_reason is not None:
                    finish[out.request_id] = out.finish_reason
            for masks in scheduler.take_step_masks():
                runner.supply_masks(masks)
        if not submitted and scheduler.num_compiling:
            time.sleep(0.005)  # a grammar compiling, nothing else to do
    assert not scheduler.has_work() and not runner.has_pending()
    # Drop the last finished sequences on the worker too.
    finished = pack_ids(scheduler.pending_finished_seq_ids)
    runner.execute(StepPlan(10**6, [], b"", b"", b"", [], finished))
    assert runner.seqs == {}
    assert runner.slots.num_free == runner.slots.capacity
    return outputs, finish, scheduler


def greedy_reference(runner, prompt: list[int], count: int) -> list[int]:
    """Plain greedy decoding, one full forward per token."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(runner.prefill_logits(tokens)[-1].argmax().item())
    return tokens[len(prompt) :]


def mixed_greedy_tokens(runner) -> dict[int, list[int]]:
    """Greedy tokens of two sequences, one prefilled in chunks beside the other's decodes and
    then decode-only steps: the step shapes a model's kernels see in serving."""
    scheduler = MiniScheduler(runner, chunk=5, token_budget=8, seed=3)
    for seq_id, tokens in enumerate([list(range(40, 49)), [77, 3]]):
        scheduler.add(seq_id, tokens, 4, SamplingParams(temperature=0.0))
    outputs = scheduler.run()
    scheduler.flush()
    return outputs
