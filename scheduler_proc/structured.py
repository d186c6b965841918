"""The scheduler's constrained requests (structured output): those whose grammar is still
compiling, and the bitmasks of the running ones.

A request with a constraint waits in ``compiling`` (status COMPILING) until its grammar is
ready, then joins the waiting queue like any other; one whose constraint does not compile is
refused with a 400. A grammar's next mask depends on the token just sampled, which the
scheduler sees only when its step answers; with two steps in flight, the next step is
planned before that. Such a plan goes out at once with ``masks_follow``: the workers run
its forward pass while the scheduler waits for the token, and its StepMasks follows as soon
as the token has come back (``ready_masks``), before any later plan. A row is never planned
while two of its tokens are in flight.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from pegainfer.config import EngineConfig
from pegainfer.protocol import RequestRejected, StepMasks, StepPlan, pack_ids
from scheduler_proc.admission import reject, turn_away
from scheduler_proc.grammar import (
    BitmaskBuffer,
    CompileJob,
    CompilerBusy,
    GrammarCompiler,
    GrammarError,
    RequestGrammar,
)
from scheduler_proc.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class ConstrainedRequests:
    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._compiler: GrammarCompiler | None = None
        self._bitmask: BitmaskBuffer | None = None
        self.compiling: list[Request] = []
        self._jobs: dict[str, CompileJob] = {}
        # Constrained requests not finished (compiling, waiting or running): while none,
        # planning skips every grammar check.
        self.num_live = 0
        # Plans sent with ``masks_follow``, oldest first, with their rows (seq id, request).
        self.deferred: deque[tuple[int, list[tuple[int, Request]]]] = deque()

    def _get_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            model = self._config.model
            if model is None:
                raise GrammarError("structured output needs the model's tokenizer")
            self._compiler = GrammarCompiler(
                self._config.model_path, model.vocab_size, list(model.eos_token_ids)
            )
            self._bitmask = BitmaskBuffer(self._compiler.bitmask_words())
        return self._compiler

    def start(self, request: Request) -> RequestRejected | None:
        """Start compiling the request's grammar; it waits in ``compiling`` meanwhile."""
        structured = request.sampling.structured
        assert structured is not None
        try:
            job = self._get_compiler().submit(structured)
        except GrammarError as exc:
            return reject(request.request_id, str(exc), "response_format")
        except CompilerBusy as exc:
            return turn_away(request.request_id, str(exc), "grammar_compiler_busy")
        request.status = RequestStatus.COMPILING
        self._jobs[request.request_id] = job
        self.compiling.append(request)
        self.num_live += 1
        return None

    def settle(self, requests: dict[str, Request]) -> tuple[list[Request], list[RequestRejected]]:
        """The requests whose grammar is now ready (their matchers made), and the
        rejections of those whose constraint failed to compile, which leave ``requests``."""
        ready: list[Request] = []
        rejections: list[RequestRejected] = []
        still: list[Request] = []
        timeout = self._config.grammar_compile_timeout
        now = time.monotonic()
        for request in self.compiling:
            job = self._jobs[request.request_id]
            if not job.future.done():
                overran = timeout > 0 and job.started_at is not None
                if not (overran and now - job.started_at > timeout):
                    still.append(request)
                    continue
                assert self._compiler is not None
                self._compiler.abandon_running()
                reason = (
                    f"the {job.structured.kind} constraint did not compile within "
                    f"{timeout:g} s (--grammar-compile-timeout)"
                )
                logger.warning("%s: %s; its compile goes on unawaited", request.request_id, reason)
                self._refuse(request, requests, reason, rejections)
                continue
            try:
                opens_after = request.sampling.structured.after_token_id
                request.grammar = RequestGrammar(job.future.result(), opens_after)
                del self._jobs[request.request_id]
                request.status = RequestStatus.WAITING
                ready.append(request)
                continue
            except GrammarError as exc:
                reason = str(exc)
            except Exception as exc:  # a compiler failure must not take the scheduler down
                logger.exception("compiling the constraint of %s failed", request.request_id)
                reason = f"the constraint could not be compiled: {exc}"
            self._refuse(request, requests, reason, rejections)
        self.compiling = still
        return ready, rejections

    def _refuse(
        self,
        request: Request,
        requests: dict[str, Request],
        reason: str,
        rejections: list[RequestRejected],
    ) -> None:
        del self._jobs[request.request_id]
        self.num_live -= 1
        del requests[request.request_id]
        request.status = RequestStatus.FINISHED
        rejections.append(reject(request.request_id, reason, "response_format"))

    def drop(self, request: Request) -> None:
        """A request leaves for good (finished or aborted)."""
        if request.sampling.structured is None:
            return
        if request.status is RequestStatus.COMPILING:
            self.compiling.remove(request)
            job = self._jobs.pop(request.request_id, None)
            if job is not None:
                job.future.cancel()
        self.num_live -= 1
        request.grammar = None

    def accept(self, request: Request, token_id: int) -> None:
        grammar = request.grammar
        assert grammar is not None
        if not grammar.accept(token_id) and grammar.num_rejected == 1:
            logger.warning(
                "request %s: token %d is outside its grammar", request.request_id, token_id
            )
        if grammar.matcher.is_terminated():
            # Its stop token drawn, by a request that goes on (ignore_eos): the grammar has
            # ended, and the tokens after it are free, with no mask to wait for.
            request.grammar = None

    def mark(self, plan: StepPlan, requests: list[Request], samplers: list[int]) -> None:
        """Give the plan its constrained sampling rows: with their bitmask, or, if a row's
        token of the step before is still in flight (two pending: that one and this plan's),
        with ``masks_follow``, the bitmask left to ``ready_masks``.

        A sleeping grammar (``RequestGrammar.opens_after``) sends its first mask once, with
        its sequence; a step whose row's token before is in flight, which may be the one
        that wakes it, lists the row in ``gated_seq_ids``, and the worker applies that mask
        only if the token is the one. Those steps never wait for a mask."""
        if plan.new_seqs:
            self._send_first_masks(plan, requests)
        sampling = set(samplers)
        rows = [r for r in requests if r.grammar is not None and r.seq_id in sampling]
        if not rows:
            return
        assert self._bitmask is not None
        waking = [r.seq_id for r in rows if r.grammar.asleep and r.num_pending_tokens > 1]
        if waking:
            plan.gated_seq_ids = pack_ids(waking)
        awake = [r for r in rows if not r.grammar.asleep]
        if any(r.num_pending_tokens > 1 for r in awake):
            plan.masked_seq_ids = pack_ids([r.seq_id for r in awake])
            plan.masks_follow = True
            self.deferred.append((plan.step_id, [(r.seq_id, r) for r in awake]))
            return
        # A grammar that has ended (its stop token drawn, the request ignoring EOS) no
        # longer constrains the tokens after it.
        awake = [r for r in awake if not r.grammar.matcher.is_terminated()]
        if awake:
            plan.masked_seq_ids = pack_ids([r.seq_id for r in awake])
            plan.token_bitmask = self._bitmask.pack([r.grammar for r in awake])

    def _send_first_masks(self, plan: StepPlan, requests: list[Request]) -> None:
        """Each new sequence of a sleeping grammar carries that grammar's first mask."""
        assert self._bitmask is not None or not self.num_live
        by_seq = {r.seq_id: r for r in requests}
        for new in plan.new_seqs:
            grammar = by_seq[new.seq_id].grammar
            if grammar is not None and grammar.asleep:
                assert self._bitmask is not None
                new.first_mask = grammar.first_mask(self._bitmask)

    def ready_masks(self, live: dict[int, Request]) -> list[StepMasks]:
        """The masks of deferred plans whose rows' grammars have taken every token before
        the plan's, in plan order. A row whose request has left (finished, aborted,
        preempted: the worker drops its token) or whose grammar has ended allows every
        token."""
        ready = []
        while self.deferred:
            step_id, rows = self.deferred[0]
            current = [live.get(seq_id) is request for seq_id, request in rows]
            if any(c and r.num_pending_tokens > 1 for c, (_, r) in zip(current, rows)):
                break
            self.deferred.popleft()
            grammars = [
                r.grammar if c and _constrains(r.grammar) else None
                for c, (_, r) in zip(current, rows)
            ]  # fmt: skip
            assert self._bitmask is not None
            bitmask = self._bitmask.pack(grammars)
            ready.append(StepMasks(step_id, pack_ids([seq_id for seq_id, _ in rows]), bitmask))
        return ready

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()


def _constrains(grammar: RequestGrammar | None) -> bool:
    """Whether the grammar limits the next token: it has not ended."""
    return grammar is not None and not grammar.matcher.is_terminated()
