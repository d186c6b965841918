"""How a request leaves the workers (preempted, finished), and the deferred bookkeeping.

A part of ``Scheduler`` (scheduler.py), which owns the state named below. What the next
message out (a plan to the workers, a step's outputs to the detokenizer) does not depend on
waits until it is sent (``run_deferred``): indexing a plan's blocks in the prefix cache,
freeing a finished request's blocks (and its state, a long prompt among it), and the
per-request log lines. A finished request leaves the running set and the seq id map at
once, so nothing can plan or feed it; only its blocks stay referenced until then.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from scheduler_proc.bad_words import BadWordBans
from scheduler_proc.block_manager import BlockManager
from scheduler_proc.request import Request, RequestStatus
from scheduler_proc.structured import ConstrainedRequests

# The scheduler's own logger: these lines have always come from it.
logger = logging.getLogger("scheduler_proc.scheduler")


class RequestEndings:
    # The Scheduler's state that ending requests reads and changes.
    _requests: dict[str, Request]
    _waiting: deque[Request]
    _running: list[Request]
    _seq_to_request: dict[int, Request]
    _finished_seq_ids: list[int]
    _clock: Callable[[], float]
    block_manager: BlockManager
    constrained: ConstrainedRequests
    bad_words: BadWordBans
    _enqueue: Callable[..., None]  # queue a waiting request (the Scheduler's)
    num_preemptions: int

    def __init__(self) -> None:
        # Deferred until ``run_deferred``: admissions to log (request id, prompt tokens,
        # cached tokens), and finished requests whose blocks are still to be freed.
        self._admitted: list[tuple[str, int, int]] = []
        self._finished: list[Request] = []

    # A method of Scheduler (an annotation only: nothing here shadows it).
    flush_prefix_cache: Callable[[], None]

    def run_deferred(self) -> None:
        """Do what was kept off the way of the last message out: index the last plan's
        blocks, log admissions, free finished requests' blocks and log their summaries."""
        self.flush_prefix_cache()
        if self._admitted:
            admitted, self._admitted = self._admitted, []
            for request_id, num_prompt, num_cached in admitted:
                logger.info(
                    "admitted request %s: %d prompt tokens, %d cached",
                    request_id,
                    num_prompt,
                    num_cached,
                )
        if self._finished:
            finished, self._finished = self._finished, []
            log = logger.isEnabledFor(logging.INFO)
            for request in finished:
                self._free_blocks(request)
                if log:
                    logger.info("finished request %s: %s", request.request_id, request.summary())

    def _release(self, request: Request) -> None:
        """Take a running request off the workers: retire its seq id, free its blocks."""
        self._detach(request)
        self._free_blocks(request)

    def _detach(self, request: Request) -> None:
        """Take a running request off the running set and retire its seq id; it keeps its
        blocks (``_free_blocks``)."""
        self._running.remove(request)
        del self._seq_to_request[request.seq_id]
        self._finished_seq_ids.append(request.seq_id)
        request.seq_id = -1
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0

    def _free_blocks(self, request: Request) -> None:
        """Drop the request's references to its blocks; the prefix cache keeps the indexed
        ones as cached blocks."""
        self.block_manager.free(request.block_ids)
        request.block_ids = []
        request.prefix_nodes = []

    def _preempt(self, request: Request) -> None:
        # Recompute, not swap: its prompt and output come back later as a new sequence.
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, preempted=True)
        logger.debug(
            "preempted request %s (%d tokens) to free KV blocks",
            request.request_id,
            request.num_tokens,
        )

    def _finish(self, request: Request, finish_reason: str, stop_reason: int | str | None) -> None:
        """End the request now; its blocks are freed and its summary logged by the next
        ``run_deferred``, once its last output is on its way."""
        if request.sampling.structured is not None:
            self.constrained.drop(request)
        self.bad_words.drop(request.request_id)
        if request.status is RequestStatus.RUNNING:
            self._detach(request)
        elif request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = finish_reason
        request.stop_reason = stop_reason
        request.finish_time = self._clock()
        del self._requests[request.request_id]
        self._finished.append(request)
