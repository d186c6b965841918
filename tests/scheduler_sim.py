"""Scheduler test helpers.

``SimWorker`` checks every plan against the step contract and samples tokens from a function
of the sequence so far, so a recomputed sequence gets the same tokens. It models the KV
cache's content: the "KV" a step writes at a position is the context up to that position as
read through the cache (the previous position's slot plus the new token), and a sampled
token is a function of the context read from the last slot. A block reused with the wrong
content (another prefix, stale data) therefore changes the outputs, as it would on a GPU;
with ``strict`` the worker also asserts the context it read is the sequence's own.
``Harness`` drives a ``Scheduler`` with it, keeping up to N steps in flight.
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pegainfer.config import EngineConfig, ModelInfo
from pegainfer.protocol import (
    RequestRejected,
    SamplingParams,
    SeqOutput,
    StepPlan,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.scheduler import Scheduler

EOS = 2
TokenFn = Callable[[list[int]], int]


def make_config(**overrides) -> EngineConfig:
    values = dict(
        model_path="unused",
        served_model_name="x",
        block_size=4,
        max_num_seqs=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        num_kv_blocks=64,
        model=ModelInfo(
            architecture="LlamaForCausalLM",
            vocab_size=100,
            max_position_embeddings=128,
            eos_token_ids=[EOS],
            bos_token_id=1,
            num_hidden_layers=1,
            num_kv_heads=1,
            head_dim=8,
            hidden_size=8,
        ),
    )
    values.update(overrides)
    return EngineConfig(**values)


def make_request(
    request_id: str, prompt: list[int], arrival_time: float = 0.0, **sampling
) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=request_id,
        prompt_token_ids=pack_ids(prompt),
        sampling=SamplingParams(**sampling),
        arrival_time=arrival_time,
    )


def hashed_token(tokens: list[int], eos_every: int = 13) -> int:
    """A deterministic "model": the next token depends only on the tokens so far."""
    h = zlib.crc32(pack_ids(tokens))
    return EOS if h % eos_every == 0 else 10 + h % 40


@dataclass
class SimSeq:
    tokens: list[int]
    num_prompt_tokens: int
    num_computed: int | None = None  # None until its first step says where it starts
    blocks: list[int] = field(default_factory=list)


class SimWorker:
    """Executes plans the way a worker rank 0 would, asserting the contract as it goes."""

    def __init__(
        self, config: EngineConfig, token_fn: TokenFn = hashed_token, strict: bool = True
    ) -> None:
        self.config = config
        self.token_fn = token_fn
        self.strict = strict
        self.seqs: dict[int, SimSeq] = {}
        self.ever_seen: set[int] = set()
        # Live seqs referencing each block: shared blocks are read, never written.
        self.block_users: dict[int, set[int]] = {}
        # The KV cache: slot -> the context (token tuple) its KV was computed from.
        self.kv: dict[int, tuple[int, ...]] = {}
        # Slot -> (step id, seq id) that wrote it: another sequence may read it only from a
        # later step (a GPU may run one step's sequences in any order).
        self.kv_writer: dict[int, tuple[int, int]] = {}
        self.plans: list[StepPlan] = []
        self.num_sampled = 0
        self.num_reused_tokens = 0  # tokens new sequences found computed in their blocks

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for seq_id in unpack_ids(plan.finished_seq_ids):
            seq = self.seqs.pop(seq_id)  # KeyError: dropped twice, or never sent
            for block in seq.blocks:
                users = self.block_users[block]
                users.remove(seq_id)
                if not users:
                    del self.block_users[block]
        for new in plan.new_seqs:
            assert new.seq_id not in self.ever_seen, f"seq {new.seq_id} sent twice"
            self.ever_seen.add(new.seq_id)
            tokens = unpack_ids(new.token_ids)
            assert 0 < new.num_prompt_tokens <= len(tokens)
            self.seqs[new.seq_id] = SimSeq(tokens, new.num_prompt_tokens)
        for update in plan.block_updates:
            seq = self.seqs[update.seq_id]
            for block in unpack_ids(update.block_ids):
                assert 0 <= block < self.config.num_kv_blocks
                assert block not in seq.blocks, f"block {block} twice in one table"
                self.block_users.setdefault(block, set()).add(update.seq_id)
                seq.blocks.append(block)
        seq_ids = unpack_ids(plan.seq_ids)
        computed = unpack_ids(plan.num_computed)
        scheduled = unpack_ids(plan.num_scheduled)
        assert len(seq_ids) == len(computed) == len(scheduled) > 0
        assert len(set(seq_ids)) == len(seq_ids)
        assert len(seq_ids) <= self.config.max_num_seqs
        assert sum(scheduled) <= self.config.max_num_batched_tokens
        sampled_seqs, sampled_tokens = [], []
        for seq_id, num_computed, num_scheduled in zip(seq_ids, computed, scheduled):
            seq = self.seqs[seq_id]
            assert num_scheduled > 0
            if seq.num_computed is None:  # a new sequence: it may start on cached blocks
                assert num_computed % self.config.block_size == 0
                assert num_computed < len(seq.tokens)
                seq.num_computed = num_computed
                self.num_reused_tokens += num_computed
            assert num_computed == seq.num_computed
            assert num_computed + num_scheduled <= len(seq.tokens)
            assert len(seq.blocks) * self.config.block_size >= num_computed + num_scheduled
            assert num_computed + num_scheduled <= self.config.max_model_len
            context = self._compute(
                plan.step_id, seq_id, seq, num_computed, num_computed + num_scheduled
            )
            seq.num_computed += num_scheduled
            if seq.num_computed == len(seq.tokens):
                if self.strict:
                    assert list(context) == seq.tokens, f"seq {seq_id} read KV of another prefix"
                token = self.token_fn(list(context))
                seq.tokens.append(token)
                sampled_seqs.append(seq_id)
                sampled_tokens.append(token)
        self.num_sampled += len(sampled_seqs)
        return StepResult(
            step_id=plan.step_id,
            seq_ids=pack_ids(sampled_seqs),
            token_ids=pack_ids(sampled_tokens),
        )

    def _slot(self, seq: SimSeq, position: int) -> int:
        block_size = self.config.block_size
        return seq.blocks[position // block_size] * block_size + position % block_size

    def _compute(
        self, step_id: int, seq_id: int, seq: SimSeq, start: int, end: int
    ) -> tuple[int, ...]:
        """Write the KV of positions ``start:end``, each from the previous slot's KV as read
        from the cache; returns the context read at the last position."""
        context: tuple[int, ...] = ()
        if start > 0:
            previous = self._slot(seq, start - 1)
            assert previous in self.kv, f"seq {seq_id} reads position {start - 1}, never written"
            writer_step, writer_seq = self.kv_writer[previous]
            assert writer_seq == seq_id or writer_step < step_id, (
                f"seq {seq_id} reads KV that seq {writer_seq} writes in the same step"
            )
            context = self.kv[previous]
        for position in range(start, end):
            block = seq.blocks[position // self.config.block_size]
            assert self.block_users[block] == {seq_id}, (
                f"seq {seq_id} writes block {block}, which {self.block_users[block]} share"
            )
            context = context + (seq.tokens[position],)
            slot = self._slot(seq, position)
            self.kv[slot] = context
            self.kv_writer[slot] = (step_id, seq_id)
        return context


def reference_output(
    prompt: list[int],
    sampling: SamplingParams,
    max_model_len: int,
    token_fn: TokenFn = hashed_token,
    eos_ids: tuple[int, ...] = (EOS,),
) -> tuple[list[int], str, int | None]:
    """What a request must produce with unlimited resources: its tokens, reason, stop reason."""
    tokens = list(prompt)
    output: list[int] = []
    while True:
        token = token_fn(tokens)
        tokens.append(token)
        output.append(token)
        can_stop = len(output) >= sampling.min_tokens
        if can_stop and token in sampling.stop_token_ids:
            return output, "stop", token
        if can_stop and not sampling.ignore_eos and token in eos_ids:
            return output, "stop", None
        if len(output) >= sampling.max_tokens or len(tokens) >= max_model_len:
            return output, "length", None


class Harness:
    """A scheduler plus a simulated worker, with up to ``steps_in_flight`` steps pending."""

    def __init__(
        self,
        config: EngineConfig,
        steps_in_flight: int = 1,
        token_fn: TokenFn = hashed_token,
        flush_after_plan: bool = True,
        defer: bool = False,
    ) -> None:
        self.config = config
        # As the scheduler process does once a plan (or, with ``defer``, a step's outputs)
        # is sent: the deferred bookkeeping (``run_deferred``); else the next call does it.
        self.flush_after_plan = flush_after_plan
        # Results and aborts through ``apply_*``, as the process takes them: finished
        # requests keep their blocks until the deferred bookkeeping runs.
        self.defer = defer
        self.now = 0.0
        self.scheduler = Scheduler(config, clock=lambda: self.now)
        self.worker = SimWorker(config, token_fn)
        self.steps_in_flight = steps_in_flight
        self.pending: deque[StepResult] = deque()
        self.outputs: dict[str, list[int]] = {}
        self.finishes: dict[str, SeqOutput] = {}
        self.plans: list[StepPlan] = []

    def add(self, request: TokenizedRequest) -> RequestRejected | None:
        return self.scheduler.add_request(request)

    def abort(self, request_ids: list[str]) -> list[SeqOutput]:
        if self.defer:
            outputs = self.scheduler.apply_aborts(request_ids)
            self.settle()
        else:
            outputs = self.scheduler.abort(request_ids)
        self.record(outputs)
        return outputs

    def settle(self) -> None:
        """What the process does once it has sent a message, if this harness does it."""
        if self.flush_after_plan:
            self.scheduler.run_deferred()

    def record(self, outputs: list[SeqOutput]) -> None:
        for output in outputs:
            assert output.request_id not in self.finishes, "output after the finish event"
            tokens = self.outputs.setdefault(output.request_id, [])
            tokens.extend(unpack_ids(output.new_token_ids))
            assert output.completion_tokens == len(tokens)
            assert output.cached_tokens % self.config.block_size == 0
            assert 0 <= output.cached_tokens < output.prompt_tokens
            if not self.config.enable_prefix_caching:
                assert output.cached_tokens == 0
            if output.finish_reason is not None:
                self.finishes[output.request_id] = output

    def plan(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.plans.append(plan)
            self.pending.append(self.worker.execute(plan))
            self.settle()
        return plan

    def deliver(self) -> list[SeqOutput]:
        if self.defer:
            outputs = self.scheduler.apply_step_result(self.pending.popleft())
            self.settle()
        else:
            outputs = self.scheduler.on_step_result(self.pending.popleft())
        self.record(outputs)
        return outputs

    def step(self) -> bool:
        """Plan if allowed, deliver the oldest result if the pipeline is full; progress?"""
        self.now += 0.01
        plan = None
        if self.scheduler.num_steps_in_flight < self.steps_in_flight:
            plan = self.plan()
        delivered = False
        if self.pending and (plan is None or len(self.pending) >= self.steps_in_flight):
            self.deliver()
            delivered = True
        self.check_invariants()
        assert self.scheduler.num_running <= self.config.max_num_seqs
        assert self.scheduler.num_steps_in_flight == len(self.pending)
        return plan is not None or delivered

    def run_until_idle(self, max_steps: int = 20_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work() and not self.pending:
                return
            assert self.step(), "work remains but nothing can be planned or delivered"
        raise AssertionError("requests hung")

    def check_invariants(self) -> None:
        """Block states are consistent, and every block's ref count is exactly the number
        of running requests whose table holds it."""
        scheduler = self.scheduler
        manager = scheduler.block_manager
        manager.check_invariants()
        if scheduler.prefix_cache is not None:
            scheduler.prefix_cache.check_invariants()
        # Finished requests whose deferred bookkeeping has not run still hold their blocks.
        holders = Counter(
            b for r in (*scheduler._running, *scheduler._finished) for b in r.block_ids
        )
        for block_id in range(manager.num_blocks):
            assert manager.ref_count(block_id) == holders[block_id], f"block {block_id} leaked"

    def assert_drained(self) -> None:
        manager = self.scheduler.block_manager
        self.scheduler.run_deferred()  # as the process does after its last message
        self.check_invariants()
        assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
        # The worker still holds exactly the seqs the next plan will drop.
        assert set(self.worker.seqs) == set(self.scheduler.pending_finished_seq_ids)
        # Cached blocks are evictable: the whole cache can be allocated, which empties the
        # prefix index, and given back.
        blocks = manager.allocate(manager.num_blocks)
        if self.scheduler.prefix_cache is not None:
            assert len(self.scheduler.prefix_cache) == 0
            assert self.scheduler.prefix_cache.num_indexed_blocks == 0
        manager.free(blocks)
        self.check_invariants()
        assert manager.num_cached_blocks == 0


def constant(token: int) -> TokenFn:
    return lambda tokens: token


def scripted(*tokens: int, then: int = 10) -> TokenFn:
    """Emit these tokens as a single sequence's 1st, 2nd, ... generated token."""
    state = {"prompt_len": None}

    def next_token(seq_tokens: list[int]) -> int:
        if state["prompt_len"] is None:
            state["prompt_len"] = len(seq_tokens)
        index = len(seq_tokens) - state["prompt_len"]
        return tokens[index] if index < len(tokens) else then

    return next_token
