"""The scheduling policy: continuous batching with chunked prefill and recompute preemption.

Pure logic, no sockets and no torch, so it is unit-tested directly. ``main`` feeds it
messages and sends what it returns.

Steps in flight: ``schedule`` may be called again before the previous step's result has
arrived. A request's ``num_computed_tokens`` is advanced when its step is planned, and the
token that step will sample is counted in ``num_pending_tokens``, so the next plan can
already schedule the decode of that (still unknown to us) token: the worker feeds it forward
on the GPU. Stop conditions are therefore reconciled late: when a result shows that a
request stopped, a later in-flight step may still sample a token for it; that token arrives
for a sequence id that is no longer live and is dropped. The same holds for tokens of
aborted and preempted sequences. Limits that do not depend on token values (max_tokens,
max_model_len) are honoured exactly: a request is not planned past them.

Prefix cache (prefix_cache.py): a waiting request starts on the cached blocks of its longest
cached prefix, so its first plan row has ``num_computed`` > 0 and its block table begins
with those shared blocks. The full blocks a plan computes are indexed after it is built
(``flush_prefix_cache``, which the process calls once the plan is sent), so only later steps,
which the workers run after it, can read them.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from pegainfer.config import EngineConfig
from pegainfer.protocol import (
    ProtocolError,
    RequestRejected,
    SeqOutput,
    StepPlan,
    StepResult,
    TokenizedRequest,
    unpack_ids,
)
from scheduler_proc.admission import AdmissionPlan, EarlyAborts, check_admission, plan_admission
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.stats import SchedulerStats
from scheduler_proc.step_builder import StepBuilder
from scheduler_proc.stop import check_stop

logger = logging.getLogger(__name__)

# How many aborted-but-never-seen request ids to remember (see ``abort``).
EARLY_ABORT_MEMORY = 4096


class Scheduler:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.time) -> None:
        if config.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks is not set; the workers have not reported it")
        max_model_len = config.max_model_len
        if max_model_len <= 0 and config.model is not None:
            max_model_len = config.model.max_position_embeddings
        if max_model_len <= 0 or config.max_num_batched_tokens <= 0 or config.max_num_seqs <= 0:
            raise ValueError("max_model_len, max_num_batched_tokens and max_num_seqs must be set")
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(config.model.eos_token_ids if config.model else ())
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(self.block_manager) if config.enable_prefix_caching else None
        )
        self._clock = clock

        self._requests: dict[str, Request] = {}  # every waiting or running request
        self._waiting: deque[Request] = deque()  # FCFS; preempted requests go to the front
        self._running: list[Request] = []  # kept sorted oldest first (priority_key)
        self._seq_to_request: dict[int, Request] = {}  # live seq ids of running requests
        # step_id -> seq ids that sample a token in that step, for steps not yet answered.
        self._in_flight: dict[int, list[int]] = {}
        # Seq ids the workers must drop before the next step (finished, aborted, preempted).
        self._finished_seq_ids: list[int] = []
        self._early_aborts = EarlyAborts(EARLY_ABORT_MEMORY)
        # Requests of the last plan whose new full blocks the prefix cache has not indexed
        # yet (see ``flush_prefix_cache``).
        self._unindexed: list[Request] = []
        self._next_seq_id = 0
        self._next_step_id = 0
        self._next_arrival_index = 0

        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Prefix cache: tokens looked up and tokens found, at every admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Prompt tokens whose KV was computed (the prefill token count): what the prefix
        # cache saves shows up here.
        self.prompt_tokens_computed = 0

    # -- queries ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def pending_finished_seq_ids(self) -> list[int]:
        """Seq ids that the next plan will tell the workers to drop."""
        return list(self._finished_seq_ids)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def request_of_seq(self, seq_id: int) -> Request | None:
        """The running request that owns a live seq id."""
        return self._seq_to_request.get(seq_id)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache_usage,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_preemptions=self.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_steps_in_flight=self.num_steps_in_flight,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prompt_tokens_computed=self.prompt_tokens_computed,
            num_cached_blocks=self.block_manager.num_cached_blocks,
        )

    # -- inbound ---------------------------------------------------------------------------

    def add_request(self, tokenized: TokenizedRequest) -> RequestRejected | None:
        """Queue a request, or refuse it if it is malformed or could never fit."""
        if self._early_aborts.consume(tokenized.request_id):
            logger.info(
                "dropped request %s: it was aborted before it arrived", tokenized.request_id
            )
            return None
        checked = check_admission(
            tokenized,
            self._requests,
            self.max_model_len,
            self.block_manager.num_blocks,
            self.block_size,
        )
        if isinstance(checked, RequestRejected):
            return checked
        request = Request(
            request_id=tokenized.request_id,
            prompt_token_ids=checked,
            sampling=tokenized.sampling,
            arrival_time=tokenized.arrival_time,
            arrival_index=self._next_arrival_index,
        )
        self._next_arrival_index += 1
        self._requests[request.request_id] = request
        self._waiting.append(request)
        return None

    def abort(self, request_ids: Iterable[str]) -> list[SeqOutput]:
        """Finish these requests with reason "abort".

        An unknown id gets no output. It is remembered for a while, because the abort may
        have overtaken its request (which travels through a tokenizer): that request is then
        dropped on arrival instead of running for a client that has gone.
        """
        self.flush_prefix_cache()  # an aborted request's computed blocks stay reusable
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                self._early_aborts.remember(request_id)
                continue
            self._finish(request, "abort", None)
            outputs.append(request.to_output([]))
        return outputs

    def on_step_result(self, result: StepResult) -> list[SeqOutput]:
        """Take one step's sampled tokens: append them, check stops, report every change."""
        self.flush_prefix_cache()
        samplers = self._in_flight.pop(result.step_id, None)
        if samplers is None:
            logger.warning("dropped a result for step %d, which is not in flight", result.step_id)
            return []
        try:
            seq_ids = unpack_ids(result.seq_ids)
            token_ids = unpack_ids(result.token_ids)
            if len(seq_ids) != len(token_ids):
                raise ProtocolError(f"{len(seq_ids)} seq ids but {len(token_ids)} tokens")
        except ProtocolError as exc:
            logger.error(
                "step %d result is malformed (%s); its tokens are lost", result.step_id, exc
            )
            seq_ids, token_ids = [], []
        expected = set(samplers)
        answered: set[int] = set()
        outputs = []
        now = self._clock()
        for seq_id, token_id in zip(seq_ids, token_ids):
            if seq_id not in expected or seq_id in answered:
                logger.warning("step %d: unexpected token for seq %d", result.step_id, seq_id)
                continue
            answered.add(seq_id)
            request = self._seq_to_request.get(seq_id)
            if request is None:
                continue  # finished, aborted or preempted after this step was planned
            request.num_pending_tokens -= 1
            request.output_token_ids.append(token_id)
            if self.prefix_cache is not None:
                # A block whose last token was still in flight when its step was planned.
                self.prefix_cache.register(request)
            self.generation_tokens_total += 1
            if request.first_token_time is None:
                request.first_token_time = now
                self.prompt_tokens_total += request.num_prompt_tokens
            stop = check_stop(
                request.sampling,
                request.output_token_ids,
                request.num_prompt_tokens,
                self.eos_token_ids,
                self.max_model_len,
            )
            if stop is not None:
                self._finish(request, *stop)
            outputs.append(request.to_output([token_id]))
        for seq_id in samplers:
            request = self._seq_to_request.get(seq_id)
            if seq_id not in answered and request is not None:
                # Its state no longer matches the worker's; ending it beats hanging it.
                logger.error(
                    "step %d sampled no token for request %s", result.step_id, request.request_id
                )
                self._finish(request, "abort", None)
                outputs.append(request.to_output([]))
        return outputs

    # -- planning --------------------------------------------------------------------------

    def flush_prefix_cache(self) -> None:
        """Index the blocks the last plan completed. Call it once the plan is sent, to keep
        the hashing off the critical path; every other entry point calls it too."""
        if self._unindexed:
            assert self.prefix_cache is not None
            for request in self._unindexed:
                if request.status is RequestStatus.RUNNING:
                    self.prefix_cache.register(request)
            self._unindexed = []

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no request can make progress now."""
        self.flush_prefix_cache()
        budget = self.max_num_batched_tokens
        batch = StepBuilder()
        preempted = False
        block_size = self.block_size

        # Running requests first, oldest first: a request short of blocks takes them from
        # the youngest, which is therefore never one already planned in this step.
        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                index += 1
                continue
            num_tokens = request.num_computed_tokens + num_new
            num_blocks = 0
            if num_tokens > len(request.block_ids) * block_size:  # else: the common decode
                num_blocks = -(-num_tokens // block_size) - len(request.block_ids)
                while not self.block_manager.can_allocate(num_blocks):
                    victim = self._running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                if request.status is not RequestStatus.RUNNING:
                    break  # it preempted itself: every younger request is gone already
            self._plan_one(batch, request, num_new, num_blocks)
            budget -= num_new
            index += 1

        # Then waiting requests, first come first served. After a preemption the cache is
        # under pressure, so nothing new is let in this step.
        while (
            not preempted
            and self._waiting
            and budget > 0
            and len(self._running) < self.max_num_seqs
        ):
            request = self._waiting[0]
            admission = plan_admission(request, budget, self.block_manager, self.prefix_cache)
            if admission is None:
                break
            self._waiting.popleft()
            self._admit(request, admission)
            batch.add_new_sequence(request)
            self._plan_one(batch, request, admission.num_new, admission.num_blocks, new_seq=True)
            budget -= admission.num_new

        if not batch.seq_ids:
            return None
        if self.prefix_cache is not None:
            # Indexed after this plan is complete (and, ideally, sent): a block computed in
            # this step can be read from the next step on.
            self._unindexed = [
                r
                for r in batch.requests
                if r.num_computed_tokens >= (len(r.prefix_nodes) + 1) * block_size
            ]
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight[step_id] = batch.samplers
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return batch.build(step_id, finished)

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        known = request.num_known_tokens
        if request.num_pending_tokens > 0 and (
            request.num_output_tokens + request.num_pending_tokens >= request.sampling.max_tokens
            or known >= self.max_model_len
        ):
            return 0  # its last token is in flight; another step would sample past the limit
        return max(0, min(known - request.num_computed_tokens, budget))

    def _plan_one(
        self,
        batch: StepBuilder,
        request: Request,
        num_new: int,
        num_blocks: int,
        new_seq: bool = False,
    ) -> None:
        """Add ``num_new`` tokens of the request to the step, with ``num_blocks`` more blocks.
        A new sequence's update carries its whole table (prefix cache hits first)."""
        seq_id = request.seq_id
        first_unsent = 0 if new_seq else len(request.block_ids)
        if num_blocks > 0:
            request.block_ids.extend(self.block_manager.allocate(num_blocks))
        if len(request.block_ids) > first_unsent:
            batch.add_blocks(seq_id, request.block_ids[first_unsent:])
        computed = request.num_computed_tokens
        # The worker samples when the computed tokens reach the length it knows.
        samples = computed + num_new == request.num_known_tokens
        batch.add_row(request, computed, num_new, samples)
        request.num_computed_tokens = computed + num_new
        if samples:
            request.num_pending_tokens += 1
        if computed < request.num_prompt_tokens:
            prompt_part = min(computed + num_new, request.num_prompt_tokens) - computed
            request.num_computed_prompt_tokens += prompt_part
            self.prompt_tokens_computed += prompt_part

    # -- state changes ---------------------------------------------------------------------

    def _admit(self, request: Request, admission: AdmissionPlan) -> None:
        """Start a waiting request as a new sequence whose first blocks are the prefix
        cache's hits (their KV is there already)."""
        request.seq_id = self._next_seq_id
        self._next_seq_id = (self._next_seq_id + 1) & 0x7FFFFFFF  # it travels as int32
        request.status = RequestStatus.RUNNING
        self.block_manager.incref(admission.hit_blocks)
        request.block_ids = list(admission.hit_blocks)
        request.prefix_nodes = list(admission.hits)
        request.prefix_chain_broken = False
        num_cached = admission.num_cached
        request.num_computed_tokens = num_cached
        request.num_pending_tokens = 0
        if self.prefix_cache is not None:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
        self._seq_to_request[request.seq_id] = request
        bisect.insort(self._running, request, key=lambda r: r.priority_key)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            logger.info(
                "admitted request %s: %d prompt tokens, %d cached",
                request.request_id,
                request.num_prompt_tokens,
                num_cached,
            )
        else:
            logger.debug(
                "re-admitted request %s: recomputing %d of %d tokens",
                request.request_id,
                request.num_tokens - num_cached,
                request.num_tokens,
            )

    def _release(self, request: Request) -> None:
        """Take a running request off the workers: free its blocks, retire its seq id."""
        self._running.remove(request)
        del self._seq_to_request[request.seq_id]
        self._finished_seq_ids.append(request.seq_id)
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.prefix_nodes = []
        request.seq_id = -1
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: its prompt and output come back later as a new sequence.
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(request)
        logger.debug(
            "preempted request %s (%d tokens) to free KV blocks",
            request.request_id,
            request.num_tokens,
        )

    def _finish(self, request: Request, finish_reason: str, stop_reason: int | str | None) -> None:
        if request.status is RequestStatus.RUNNING:
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = finish_reason
        request.stop_reason = stop_reason
        request.finish_time = self._clock()
        del self._requests[request.request_id]
        logger.info("finished request %s: %s", request.request_id, request.summary())
