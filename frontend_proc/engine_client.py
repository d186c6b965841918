"""The frontend's side of the process tree: send requests in, route text deltas back.

Requests go to the tokenizers (a PUSH the frontend binds; ZeroMQ spreads them round-robin);
aborts go straight to the scheduler. One background task reads the ``frontend`` socket and
hands each TextDelta or RequestRejected to the queue of its request id. Output for an id with
no queue (an aborted request's last step) is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import zmq
import zmq.asyncio

from frontend_proc.errors import APIError
from pegainfer import ipc
from pegainfer.protocol import (
    AbortRequests,
    GenerateRequest,
    RequestRejected,
    TextDelta,
    TextOutputs,
)

logger = logging.getLogger(__name__)

_INBOUND = (TextOutputs, RequestRejected)


class EngineClientProtocol(Protocol):
    """What the HTTP layer needs from the engine; tests substitute a fake."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TextDelta]: ...

    def abort(self, request_ids: list[str]) -> None: ...


class EngineClient:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._async_ctx = zmq.asyncio.Context()
        # Sends never block (no high-water mark), so plain sockets do; that keeps abort()
        # synchronous, which a finally block of a cancelled handler can always run.
        self._sync_ctx = zmq.Context.shadow(self._async_ctx.underlying)
        self._to_tokenizers = ipc.bind(self._sync_ctx, zmq.PUSH, run_dir, "tokenizer")
        self._to_scheduler = ipc.connect(self._sync_ctx, zmq.PUSH, run_dir, "scheduler")
        self._inbound = ipc.bind(self._async_ctx, zmq.PULL, run_dir, "frontend")
        self._queues: dict[str, asyncio.Queue[TextDelta | RequestRejected]] = {}
        self._receiver: asyncio.Task[None] | None = None

    @property
    def num_active(self) -> int:
        return len(self._queues)

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
        for sock in (self._to_tokenizers, self._to_scheduler, self._inbound):
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

    def dispatch(self, msg: TextOutputs | RequestRejected) -> None:
        items: list[TextDelta] | list[RequestRejected] = (
            msg.outputs if isinstance(msg, TextOutputs) else [msg]
        )
        for item in items:
            queue = self._queues.get(item.request_id)
            if queue is not None:
                queue.put_nowait(item)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TextDelta]:
        """The text deltas of one request until it finishes; a rejection raises APIError.

        The queue lives exactly as long as this generator, so a consumer that stops early (or is
        cancelled) leaves nothing behind; telling the scheduler to stop is the caller's job
        (``abort``), since only it knows whether the request had finished.
        """
        request_id = request.request_id
        if request_id in self._queues:
            raise APIError(500, f"request id {request_id} is already in flight", "server_error")
        queue: asyncio.Queue[TextDelta | RequestRejected] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            ipc.send(self._to_tokenizers, request)
            while True:
                item = await queue.get()
                if isinstance(item, RequestRejected):
                    raise APIError.from_rejection(item)
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._queues.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> None:
        if not request_ids:
            return
        try:
            ipc.send(self._to_scheduler, AbortRequests(request_ids=list(request_ids)))
        except zmq.ZMQError:
            logger.exception("could not send an abort for %d requests", len(request_ids))
