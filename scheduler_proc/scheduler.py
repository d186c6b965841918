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
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

from pegainfer.config import EngineConfig
from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    ProtocolError,
    RequestRejected,
    SeqOutput,
    StepPlan,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.admission import check_admission
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.stats import SchedulerStats
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
        self._clock = clock

        self._requests: dict[str, Request] = {}  # every waiting or running request
        self._waiting: deque[Request] = deque()  # FCFS; preempted requests go to the front
        self._running: list[Request] = []  # kept sorted oldest first (priority_key)
        self._seq_to_request: dict[int, Request] = {}  # live seq ids of running requests
        # step_id -> seq ids that sample a token in that step, for steps not yet answered.
        self._in_flight: dict[int, list[int]] = {}
        # Seq ids the workers must drop before the next step (finished, aborted, preempted).
        self._finished_seq_ids: list[int] = []
        # Ids aborted before their request arrived (the abort overtook it on the way through
        # a tokenizer); that request is dropped when it does arrive. Oldest first, bounded.
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._next_seq_id = 0
        self._next_step_id = 0
        self._next_arrival_index = 0

        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

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
        )

    # -- inbound ---------------------------------------------------------------------------

    def add_request(self, tokenized: TokenizedRequest) -> RequestRejected | None:
        """Queue a request, or refuse it if it is malformed or could never fit."""
        if tokenized.request_id in self._early_aborts:
            del self._early_aborts[tokenized.request_id]
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
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                self._early_aborts[request_id] = None
                if len(self._early_aborts) > EARLY_ABORT_MEMORY:
                    self._early_aborts.popitem(last=False)
                continue
            self._finish(request, "abort", None)
            outputs.append(request.to_output([]))
        return outputs

    def on_step_result(self, result: StepResult) -> list[SeqOutput]:
        """Take one step's sampled tokens: append them, check stops, report every change."""
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

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no request can make progress now."""
        budget = self.max_num_batched_tokens
        batch = _StepBuilder()
        new_seqs: list[NewSequence] = []
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
            num_new = min(request.num_tokens, budget)
            num_blocks = self.block_manager.blocks_for_tokens(num_new)
            if not self.block_manager.can_allocate(num_blocks):
                break
            self._waiting.popleft()
            self._admit(request)
            new_seqs.append(
                NewSequence(
                    seq_id=request.seq_id,
                    token_ids=pack_ids(request.all_token_ids),
                    sampling=request.sampling,
                    num_prompt_tokens=request.num_prompt_tokens,
                )
            )
            self._plan_one(batch, request, num_new, num_blocks)
            budget -= num_new

        if not batch.seq_ids:
            return None
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight[step_id] = batch.samplers
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return StepPlan(
            step_id=step_id,
            new_seqs=new_seqs,
            seq_ids=pack_ids(batch.seq_ids),
            num_computed=pack_ids(batch.num_computed),
            num_scheduled=pack_ids(batch.num_scheduled),
            block_updates=batch.block_updates,
            finished_seq_ids=pack_ids(finished),
        )

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        known = request.num_known_tokens
        if request.num_pending_tokens > 0 and (
            request.num_output_tokens + request.num_pending_tokens >= request.sampling.max_tokens
            or known >= self.max_model_len
        ):
            return 0  # its last token is in flight; another step would sample past the limit
        return max(0, min(known - request.num_computed_tokens, budget))

    def _plan_one(
        self, batch: _StepBuilder, request: Request, num_new: int, num_blocks: int
    ) -> None:
        seq_id = request.seq_id
        if num_blocks > 0:
            new_blocks = self.block_manager.allocate(num_blocks)
            request.block_ids.extend(new_blocks)
            batch.block_updates.append(BlockTableUpdate(seq_id, pack_ids(new_blocks)))
        computed = request.num_computed_tokens
        batch.seq_ids.append(seq_id)
        batch.num_computed.append(computed)
        batch.num_scheduled.append(num_new)
        request.num_computed_tokens = computed + num_new
        # The worker samples when the computed tokens reach the length it knows.
        if computed + num_new == request.num_known_tokens:
            request.num_pending_tokens += 1
            batch.samplers.append(seq_id)

    # -- state changes ---------------------------------------------------------------------

    def _admit(self, request: Request) -> None:
        request.seq_id = self._next_seq_id
        self._next_seq_id = (self._next_seq_id + 1) & 0x7FFFFFFF  # it travels as int32
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0
        self._seq_to_request[request.seq_id] = request
        bisect.insort(self._running, request, key=lambda r: r.priority_key)
        if request.num_preemptions == 0:
            logger.info(
                "admitted request %s: %d prompt tokens",
                request.request_id,
                request.num_prompt_tokens,
            )
        else:
            logger.debug(
                "re-admitted request %s: recomputing %d tokens",
                request.request_id,
                request.num_tokens,
            )

    def _release(self, request: Request) -> None:
        """Take a running request off the workers: free its blocks, retire its seq id."""
        self._running.remove(request)
        del self._seq_to_request[request.seq_id]
        self._finished_seq_ids.append(request.seq_id)
        self.block_manager.free(request.block_ids)
        request.block_ids = []
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
        ttft = (
            f"{request.first_token_time - request.arrival_time:.3f}s"
            if request.first_token_time is not None
            else "-"
        )
        logger.info(
            "finished request %s: %d prompt + %d completion tokens, %s, ttft %s, total %.3fs",
            request.request_id,
            request.num_prompt_tokens,
            request.num_output_tokens,
            finish_reason,
            ttft,
            request.finish_time - request.arrival_time,
        )


class _StepBuilder:
    """The step being planned, column by column."""

    __slots__ = ("seq_ids", "num_computed", "num_scheduled", "samplers", "block_updates")

    def __init__(self) -> None:
        self.seq_ids: list[int] = []
        self.num_computed: list[int] = []
        self.num_scheduled: list[int] = []
        self.samplers: list[int] = []  # seq ids that sample a token in this step
        self.block_updates: list[BlockTableUpdate] = []
