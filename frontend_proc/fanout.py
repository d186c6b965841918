"""Run the sub-requests of one HTTP request concurrently and merge their output.

A batch of prompts, or n > 1, becomes several engine requests. ``FanOut`` runs each in its
own task and yields ``(choice_index, delta)`` in arrival order. A single request (the common
case) needs no merging: the consumer reads its stream directly, which spares every delta,
the first token's included, a pass through the event loop. Leaving the ``async with``
block by any path (normal end, error, client gone, handler cancelled) cancels the tasks or
closes the stream, and tells the scheduler to abort every sub-request that had not finished,
so no request outlives its client.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING

from frontend_proc.errors import APIError
from pegainfer.protocol import GenerateRequest, TextDelta

if TYPE_CHECKING:
    from frontend_proc.engine_client import EngineClientProtocol

logger = logging.getLogger(__name__)

# What a sub-request task puts on the merged queue: a delta, its end (None), or its error.
_Event = tuple[int, TextDelta | BaseException | None]


class FanOut:
    def __init__(self, engine: EngineClientProtocol, requests: list[GenerateRequest]) -> None:
        self.engine = engine
        self.requests = requests
        self._merged: asyncio.Queue[_Event] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._unfinished: set[int] = set(range(len(requests)))
        # The one request's stream, read by the consumer itself.
        self._stream: AsyncIterator[TextDelta] | None = None

    async def __aenter__(self) -> FanOut:
        if len(self.requests) == 1:
            self._stream = self.engine.generate(self.requests[0])
            return self
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run(index, request))
            for index, request in enumerate(self.requests)
        ]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Abort first: it is synchronous, so it happens even if this task is cancelled again
        # while waiting for the sub-request tasks below.
        unfinished = [self.requests[index].request_id for index in sorted(self._unfinished)]
        self._unfinished.clear()
        if unfinished:
            logger.info("aborting %d unfinished requests: %s", len(unfinished), unfinished[:4])
            self.engine.abort(unfinished)
        if self._stream is not None:
            await _close(self._stream)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, index: int, request: GenerateRequest) -> None:
        stream = self.engine.generate(request)
        try:
            async for delta in stream:
                self._merged.put_nowait((index, delta))
            self._merged.put_nowait((index, None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to the consumer, not lost
            self._merged.put_nowait((index, exc))
        finally:
            await _close(stream)

    def __aiter__(self) -> AsyncIterator[tuple[int, TextDelta]]:
        if self._stream is not None:
            return self._single(self._stream)
        return self._events()

    async def _single(
        self, stream: AsyncIterator[TextDelta]
    ) -> AsyncIterator[tuple[int, TextDelta]]:
        """The one request's deltas, read in the consumer's task; a failure raises as in
        ``_events``. A rejected request holds no engine state, so it is not aborted."""
        try:
            async for delta in stream:
                if delta.finish_reason is not None:
                    self._unfinished.discard(0)
                yield 0, delta
        except APIError:
            self._unfinished.discard(0)
            raise
        except Exception as exc:
            self._unfinished.discard(0)
            raise _as_api_error(exc) from exc
        self._unfinished.discard(0)

    async def _events(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """Deltas until every sub-request has ended; the first failure raises."""
        running = len(self.requests)
        while running:
            index, item = await self._merged.get()
            if item is None:
                running -= 1
                self._unfinished.discard(index)
            elif isinstance(item, TextDelta):
                if item.finish_reason is not None:
                    self._unfinished.discard(index)
                yield index, item
            else:
                # A rejected request holds no engine state; the others are aborted on exit.
                self._unfinished.discard(index)
                if isinstance(item, APIError):
                    raise item
                raise _as_api_error(item) from item


def _as_api_error(exc: BaseException) -> APIError:
    """What the client is told of an unexpected failure of a sub-request."""
    return APIError(500, f"internal error: {type(exc).__name__}", "server_error")


async def _close(stream: AsyncIterator[TextDelta]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
