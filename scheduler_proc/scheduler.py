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

Planning (planning.py, a part of the class): the loops that put the running requests and a
newly admitted one into a step.

Results (intake.py, a part of the class): ``on_step_result`` takes a step's sampled tokens.

Endings and deferred bookkeeping (endings.py, a part of the class): what the next message
out (a plan to the workers, outputs to the detokenizer) does not depend on waits until it is
sent, in ``run_deferred``: the process calls it after each send, and every entry point calls
it first, so no decision ever sees unsettled state. The ``apply_*`` entry points leave it to
their caller; ``on_step_result`` and ``abort`` run it before they return.

Prefix cache (prefix_cache.py): a waiting request starts on the cached blocks of its longest
cached prefix, so its first plan row has ``num_computed`` > 0 and its block table begins
with those shared blocks. The full blocks a plan computes are indexed after it is built
(``flush_prefix_cache``, a part of ``run_deferred``, done once the plan is sent), so only
later steps, which the workers run after it, can read them.

Structured output (structured.py): a constrained request waits for its grammar to compile;
each plan carries the masks of its constrained rows that sample, or says that they follow
(``take_step_masks``) once the tokens they depend on have come back.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from pegainfer.config import EngineConfig
from pegainfer.protocol import (
    RequestRejected,
    SeqOutput,
    StepMasks,
    StepPlan,
    TokenizedRequest,
)
from scheduler_proc.admission import (
    AdmissionPlan,
    EarlyAborts,
    check_admission,
    plan_admission,
    reject,
)
from scheduler_proc.bad_words import BadWordBans
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.endings import RequestEndings
from scheduler_proc.intake import ResultIntake
from scheduler_proc.planning import StepPlanning
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.stats import SchedulerStats, collect_stats
from scheduler_proc.step_builder import StepBuilder
from scheduler_proc.stop import stop_screen
from scheduler_proc.structured import ConstrainedRequests

logger = logging.getLogger(__name__)

# How many aborted-but-never-seen request ids to remember (see ``abort``).
EARLY_ABORT_MEMORY = 4096


class Scheduler(StepPlanning, ResultIntake, RequestEndings):
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.time) -> None:
        if config.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks is not set; the workers have not reported it")
        max_model_len = config.max_model_len
        if max_model_len <= 0 and config.model is not None:
            max_model_len = config.model.longest_context()
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
        self.constrained = ConstrainedRequests(config)
        self.bad_words = BadWordBans()

        self._requests: dict[str, Request] = {}  # every waiting or running request
        # In priority_key order, by arrival (FCFS) or by priority; preempted requests go
        # back to the front, or by priority among the waiting.
        self._waiting: deque[Request] = deque()
        self._by_priority = config.scheduling_policy == "priority"
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
        RequestEndings.__init__(self)
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
        return bool(self._waiting or self._running or self.constrained.compiling)

    @property
    def num_compiling(self) -> int:
        """Constrained requests whose grammar is still compiling."""
        return len(self.constrained.compiling)

    def take_step_masks(self) -> list[StepMasks]:
        """The StepMasks of plans sent with ``masks_follow`` that can now be made (the
        tokens their grammars waited for have come); each goes to the sampling rank before
        any later plan."""
        return (
            self.constrained.ready_masks(self._seq_to_request) if self.constrained.deferred else []
        )

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
        return collect_stats(self)

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
        if tokenized.sampling.priority and not self._by_priority:
            return reject(
                tokenized.request_id,
                "'priority' needs a server started with --scheduling-policy priority",
                "priority",
            )
        request = Request(
            request_id=tokenized.request_id,
            prompt_token_ids=checked,
            prompt_packed=tokenized.prompt_token_ids,
            sampling=tokenized.sampling,
            arrival_time=tokenized.arrival_time,
            arrival_index=self._next_arrival_index,
        )
        request.stop_screen_ids, request.stop_screen_length = stop_screen(
            tokenized.sampling, request.num_prompt_tokens, self.eos_token_ids, self.max_model_len
        )
        self._next_arrival_index += 1
        self._requests[request.request_id] = request
        if tokenized.sampling.structured is not None:
            rejection = self.constrained.start(request)
            if rejection is not None:
                del self._requests[request.request_id]
                return rejection
        else:
            self._enqueue(request)
        self.bad_words.add(request)
        return None

    def collect_grammars(self) -> list[RequestRejected]:
        """Move the requests whose grammar has compiled to the waiting queue; refuse those
        whose constraint did not compile (their rejections, for the frontend)."""
        ready, rejections = self.constrained.settle(self._requests)
        for request in ready:
            self._enqueue(request)
        for rejection in rejections:
            self.bad_words.drop(rejection.request_id)
        return rejections

    def _enqueue(self, request: Request, preempted: bool = False) -> None:
        """Queue a waiting request: last (first if preempted), or in priority order."""
        if self._by_priority:
            key = request.priority_key
            index = bisect.bisect_right(self._waiting, key, key=lambda r: r.priority_key)
            self._waiting.insert(index, request)
        elif preempted:
            self._waiting.appendleft(request)
        else:
            self._waiting.append(request)

    def abort(self, request_ids: Iterable[str]) -> list[SeqOutput]:
        """``apply_aborts``, and the deferred bookkeeping (their blocks freed) at once."""
        outputs = self.apply_aborts(request_ids)
        self.run_deferred()
        return outputs

    def apply_aborts(self, request_ids: Iterable[str]) -> list[SeqOutput]:
        """Finish these requests with reason "abort"; their blocks are freed by the next
        ``run_deferred``.

        An unknown id gets no output. It is remembered for a while, because the abort may
        have overtaken its request (which travels through a tokenizer): that request is then
        dropped on arrival instead of running for a client that has gone.
        """
        self.run_deferred()  # an aborted request's computed blocks stay reusable
        outputs = []
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is None:
                self._early_aborts.remember(request_id)
                continue
            self._finish(request, "abort", None)
            outputs.append(request.to_output([]))
        return outputs

    # -- planning --------------------------------------------------------------------------

    def reset_prefix_cache(self) -> tuple[int, int] | None:
        """Empty the prefix cache: (entries forgotten, blocks freed), or None without one."""
        if self.prefix_cache is None:
            return None
        result = self.prefix_cache.reset()
        logger.info("prefix cache reset: %d entries forgotten, %d blocks freed", *result)
        return result

    def flush_prefix_cache(self) -> None:
        """Index the blocks the last plan completed (``run_deferred`` does, once the plan is
        sent: the indexing stays off the critical path)."""
        if self._unindexed:
            assert self.prefix_cache is not None
            for request in self._unindexed:
                if request.status is RequestStatus.RUNNING:
                    self.prefix_cache.register(request)
            self._unindexed = []

    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when no request can make progress now."""
        self.run_deferred()
        batch = StepBuilder()
        # Requests whose new full blocks the prefix cache indexes once the plan is complete
        # (and, ideally, sent): a block computed in this step can be read from the next on.
        unindexed: list[Request] | None = [] if self.prefix_cache is not None else None
        budget, preempted = self._plan_running(batch, unindexed)

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
            self._plan_new(batch, request, admission.num_new, admission.num_blocks)
            if unindexed is not None and self._completes_a_block(request):
                unindexed.append(request)
            budget -= admission.num_new

        if not batch.seq_ids:
            return None
        if unindexed is not None:
            self._unindexed = unindexed
        step_id = self._next_step_id
        self._next_step_id += 1
        self._in_flight[step_id] = batch.samplers
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        plan = batch.build(step_id, finished)
        if self.constrained.num_live:
            self.constrained.mark(plan, batch.requests, batch.samplers)
        if self.bad_words.num_live:
            self.bad_words.mark(plan, batch.requests, batch.samplers)
        return plan

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
            self._admitted.append((request.request_id, request.num_prompt_tokens, num_cached))
        else:
            logger.debug(
                "re-admitted request %s: recomputing %d of %d tokens",
                request.request_id,
                request.num_tokens - num_cached,
                request.num_tokens,
            )
