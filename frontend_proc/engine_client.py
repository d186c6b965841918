"""The frontend's side of the process tree: send requests in, route text deltas back.

Requests go to the tokenizers (a PUSH the frontend binds; ZeroMQ spreads them round-robin),
except token-id prompts the frontend has checked itself, which go straight to the scheduler
as TokenizedRequests (one hop less on their time to first token), as aborts do. One background task reads the ``frontend`` socket and
hands each TextDelta or RequestRejected to the queue of its request id. Output for an id with
no queue (an aborted request's last step) is dropped.

/tokenize and /detokenize are calls to the tokenizers over the same sockets: a
TokenizeRequest or DetokenizeRequest goes out like a request, and its one answer (a result or
a RequestRejected) comes back on the ``frontend`` socket to the future of its id.

The same socket brings the scheduler's EngineStats (for /metrics and the waiting-queue limit)
and the launcher's Drain and EngineDead. After EngineDead every request in flight fails at
once with a 503, and so does every new one: nothing waits on an engine that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import zmq
import zmq.asyncio

from frontend_proc.errors import SERVER_ERROR, APIError, invalid
from frontend_proc.metrics import RequestMetrics
from pegainfer import ipc
from pegainfer.protocol import (
    AbortRequests,
    DetokenizeRequest,
    DetokenizeResult,
    Drain,
    Drained,
    EngineDead,
    EngineStats,
    GenerateRequest,
    PrefixCacheReset,
    RequestRejected,
    ResetPrefixCache,
    TextDelta,
    TextOutputs,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
)

logger = logging.getLogger(__name__)

_INBOUND = (
    TextOutputs,
    RequestRejected,
    EngineStats,
    Drain,
    EngineDead,
    TokenizeResult,
    DetokenizeResult,
    PrefixCacheReset,
)
_Inbound = (
    TextOutputs
    | RequestRejected
    | EngineStats
    | Drain
    | EngineDead
    | TokenizeResult
    | DetokenizeResult
    | PrefixCacheReset
)
_CallAnswer = TokenizeResult | DetokenizeResult | RequestRejected | PrefixCacheReset


class EngineClientProtocol(Protocol):
    """What the HTTP layer needs from the engine; tests substitute a fake."""

    def generate(self, request: GenerateRequest | TokenizedRequest) -> AsyncIterator[TextDelta]: ...

    def abort(self, request_ids: list[str]) -> None: ...

    async def reset_prefix_cache(self) -> PrefixCacheReset: ...


def engine_dead_error(reason: str) -> APIError:
    return APIError(
        503, f"the engine is not available: {reason}", SERVER_ERROR, None, "engine_dead"
    )


class _Failure:
    """Queued to a request when the engine fails under it."""

    __slots__ = ("error",)

    def __init__(self, error: APIError) -> None:
        self.error = error


class EngineClient:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._async_ctx = zmq.asyncio.Context()
        # Sends never block (no high-water mark), so plain sockets do; that keeps abort()
        # synchronous, which a finally block of a cancelled handler can always run.
        self._sync_ctx = zmq.Context.shadow(self._async_ctx.underlying)
        self._to_tokenizers = ipc.bind(self._sync_ctx, zmq.PUSH, run_dir, "tokenizer")
        self._to_scheduler = ipc.connect(self._sync_ctx, zmq.PUSH, run_dir, "scheduler")
        self._to_launcher = ipc.connect(self._sync_ctx, zmq.PUSH, run_dir, "launcher")
        self._inbound = ipc.bind(self._async_ctx, zmq.PULL, run_dir, "frontend")
        self._queues: dict[str, asyncio.Queue[TextDelta | RequestRejected | _Failure]] = {}
        self._unstarted: set[str] = set()  # sent, no output yet
        # Calls to a tokenizer or the scheduler, by id.
        self._calls: dict[str, asyncio.Future[_CallAnswer | _Failure]] = {}
        self._receiver: asyncio.Task[None] | None = None
        self.metrics = RequestMetrics()
        self.stats: EngineStats | None = None
        self.stats_time = 0.0  # monotonic time of the latest stats
        self.dead_reason: str | None = None
        # Set by the server: called with the timeout when the launcher asks for a drain.
        self.on_drain: Callable[[float], None] | None = None

    @property
    def num_active(self) -> int:
        return len(self._queues)

    @property
    def num_unstarted(self) -> int:
        """Requests sent to the engine that have produced nothing yet (tokenizing, waiting
        or prefilling)."""
        return len(self._unstarted)

    def active_request_ids(self) -> list[str]:
        return list(self._queues)

    def start(self) -> None:
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive_loop())

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            try:
                await self._receiver
            except asyncio.CancelledError:
                pass
            self._receiver = None
        for sock in (self._to_tokenizers, self._to_scheduler, self._to_launcher, self._inbound):
            sock.close(linger=0)

    async def _receive_loop(self) -> None:
        while True:
            try:
                data = await self._inbound.recv(copy=True)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                logger.exception("receiving on the frontend socket failed")
                await asyncio.sleep(0.01)
                continue
            msg = ipc.decode_or_drop(data, _INBOUND, "frontend")
            if msg is None:
                continue
            try:
                self.dispatch(msg)
            except Exception:  # noqa: BLE001 - the receiver must outlive any one message
                logger.exception("could not dispatch a %s", type(msg).__name__)

    def dispatch(self, msg: _Inbound) -> None:
        if type(msg) is TextOutputs:  # nearly every message: tested first
            queues = self._queues
            for delta in msg.outputs:
                queue = queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
            return
        if isinstance(msg, EngineStats):
            self.stats = msg
            self.stats_time = time.monotonic()
            return
        if isinstance(msg, EngineDead):
            self.fail_all(msg.reason)
            return
        if isinstance(msg, Drain):
            if self.on_drain is not None:
                self.on_drain(msg.timeout)
            return
        if isinstance(msg, (TokenizeResult, DetokenizeResult, PrefixCacheReset)) or (
            isinstance(msg, RequestRejected) and msg.request_id in self._calls
        ):
            call = self._calls.get(msg.request_id)
            if call is not None and not call.done():
                call.set_result(msg)
            return
        items: list[TextDelta] | list[RequestRejected] = (
            msg.outputs if isinstance(msg, TextOutputs) else [msg]
        )
        for item in items:
            queue = self._queues.get(item.request_id)
            if queue is not None:
                queue.put_nowait(item)

    def fail_all(self, reason: str) -> None:
        """The engine is gone: every request in flight, and every later one, fails."""
        if self.dead_reason is None:
            logger.error("engine failure: %s; failing %d requests", reason, len(self._queues))
        self.dead_reason = reason
        error = engine_dead_error(reason)
        for queue in self._queues.values():
            queue.put_nowait(_Failure(error))
        for call in self._calls.values():
            if not call.done():
                call.set_result(_Failure(error))

    def send_drained(self, num_finished: int, num_aborted: int) -> None:
        try:
            ipc.send(self._to_launcher, Drained("frontend", num_finished, num_aborted))
        except zmq.ZMQError:
            logger.exception("could not report the drain to the launcher")

    async def generate(
        self, request: GenerateRequest | TokenizedRequest
    ) -> AsyncIterator[TextDelta]:
        """The text deltas of one request until it finishes; a rejection raises APIError.

        A ``GenerateRequest`` goes to a tokenizer process; a ``TokenizedRequest`` (token ids
        the frontend has checked itself) straight to the scheduler.

        The queue lives exactly as long as this generator, so a consumer that stops early (or is
        cancelled) leaves nothing behind; telling the scheduler to stop is the caller's job
        (``abort``), since only it knows whether the request had finished.
        """
        request_id = request.request_id
        if self.dead_reason is not None:
            raise engine_dead_error(self.dead_reason)
        if request_id in self._queues:
            raise APIError(500, f"request id {request_id} is already in flight", "server_error")
        queue: asyncio.Queue[TextDelta | RequestRejected | _Failure] = asyncio.Queue()
        self._queues[request_id] = queue
        self._unstarted.add(request_id)
        timing = _RequestTiming(request_id, request.arrival_time, self.metrics)
        ended = False  # finished, failed or rejected: the consumer got the request's end
        try:
            if isinstance(request, TokenizedRequest):
                ipc.send(self._to_scheduler, request)
            else:
                ipc.send(self._to_tokenizers, request)
            while True:
                item = await queue.get()
                if isinstance(item, _Failure):
                    ended = True
                    timing.ended_without_delta("error")
                    raise item.error
                if isinstance(item, RequestRejected):
                    ended = True
                    raise APIError.from_rejection(item)
                self._unstarted.discard(request_id)
                timing.arrived(item)
                ended = item.finish_reason is not None
                yield item
                timing.account()
                if ended:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            # The consumer left first (its client went away): the caller aborts the
            # request, which then finishes as "abort" with nobody left to count it.
            if not ended:
                timing.ended_without_delta("abort")
            raise
        finally:
            self._queues.pop(request_id, None)
            self._unstarted.discard(request_id)
            timing.account()

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult:
        answer = await self._call_tokenizer(request)
        assert isinstance(answer, TokenizeResult)
        return answer

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult:
        answer = await self._call_tokenizer(request)
        assert isinstance(answer, DetokenizeResult)
        return answer

    async def _call_tokenizer(
        self, request: TokenizeRequest | DetokenizeRequest
    ) -> TokenizeResult | DetokenizeResult:
        """Send one call to a tokenizer and wait for its answer; a rejection raises APIError."""
        request_id = request.request_id
        if self.dead_reason is not None:
            raise engine_dead_error(self.dead_reason)
        if request_id in self._calls:
            raise APIError(500, f"request id {request_id} is already in flight", SERVER_ERROR)
        call: asyncio.Future[_CallAnswer | _Failure] = asyncio.get_running_loop().create_future()
        self._calls[request_id] = call
        try:
            try:
                ipc.send(self._to_tokenizers, request)
            except (ValueError, TypeError, OverflowError) as exc:  # msgpack refused the body
                raise invalid(f"the request cannot be passed to the tokenizer: {exc}") from None
            answer = await call
        finally:
            self._calls.pop(request_id, None)
        if isinstance(answer, _Failure):
            raise answer.error
        if isinstance(answer, RequestRejected):
            raise APIError.from_rejection(answer)
        return answer

    async def reset_prefix_cache(self) -> PrefixCacheReset:
        """Ask the scheduler to empty the prefix cache, and wait for its answer."""
        if self.dead_reason is not None:
            raise engine_dead_error(self.dead_reason)
        request_id = f"reset-{uuid.uuid4().hex}"
        call: asyncio.Future[_CallAnswer | _Failure] = asyncio.get_running_loop().create_future()
        self._calls[request_id] = call
        try:
            ipc.send(self._to_scheduler, ResetPrefixCache(request_id))
            answer = await call
        finally:
            self._calls.pop(request_id, None)
        if isinstance(answer, _Failure):
            raise answer.error
        assert isinstance(answer, PrefixCacheReset)
        return answer

    def abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            ipc.send(self._to_scheduler, AbortRequests(request_ids=list(request_ids)))
        except zmq.ZMQError:
            logger.exception("could not send an abort for %d requests", len(request_ids))


class _RequestTiming:
    """Latency metrics of one engine request, and its first-token log line.

    A delta's time is taken as it arrives (``arrived``); the metrics and the log line wait
    until the consumer has handed the delta on and asks for the next (``account``): they are
    not worth a moment of its latency, the first token's least of all."""

    __slots__ = ("request_id", "arrival", "metrics", "last", "num_tokens", "_arrived")

    def __init__(self, request_id: str, arrival: float, metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.metrics = metrics
        self.last: float | None = None
        self.num_tokens = 0
        self._arrived: tuple[float, TextDelta] | None = None  # not accounted for yet

    def arrived(self, delta: TextDelta) -> None:
        self.account()
        self._arrived = (time.time(), delta)

    def account(self) -> None:
        """Record the metrics of the delta that arrived last, if not done yet."""
        if self._arrived is None:
            return
        (now, delta), self._arrived = self._arrived, None
        num_bytes = len(delta.token_ids)
        new_tokens = num_bytes // 4 if num_bytes % 4 == 0 else 0  # malformed: none
        if delta.queue_time is not None:  # on the first output only
            self.metrics.request_queue_time.observe(delta.queue_time)
        if new_tokens:
            if self.last is None:
                ttft = now - self.arrival
                self.metrics.time_to_first_token.observe(ttft)
                self._log_first_token(ttft, delta)
            else:
                per_token = (now - self.last) / new_tokens
                for _ in range(new_tokens):
                    self.metrics.inter_token_latency.observe(per_token)
            self.last = now
            self.num_tokens += new_tokens
        if delta.finish_reason is not None:
            self.metrics.e2e_request_latency.observe(now - self.arrival)
            self.metrics.count_finished(delta.finish_reason)

    def ended_without_delta(self, reason: str) -> None:
        """The request ended (an engine failure, the consumer gone) with no delta saying so."""
        self.account()
        self.metrics.count_finished(reason)

    def _log_first_token(self, ttft: float, delta: TextDelta) -> None:
        args = (
            "first token of request %s: ttft %.3fs, queued %s, %d prompt tokens (%d cached)",
            self.request_id,
            ttft,
            f"{delta.queue_time:.3f}s" if delta.queue_time is not None else "-",
            delta.prompt_tokens,
            delta.cached_tokens,
        )
        # Behind what the event loop has ready: the writes of other requests' tokens.
        try:
            asyncio.get_running_loop().call_soon(logger.info, *args)
        except RuntimeError:  # a generator finalized outside the event loop
            logger.info(*args)
