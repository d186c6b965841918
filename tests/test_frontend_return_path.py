"""The frontend's return path of a request's output, and what it keeps off the first token's
way:

- ``FanOut`` reads a single request's stream in the consumer's own task (no task, no merge
  queue), with the multi-request semantics: a request left unfinished is aborted, a rejected
  or failed one is not, an unexpected failure becomes a 500, the stream is always closed.
- ``EngineClient.generate`` records a delta's metrics and logs the first-token line only once
  the consumer has handed the delta on; the times are those of its arrival.
- The SSE response's status line and headers leave with its first event in one write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter as HttpStreamWriter
from aiohttp.test_utils import make_mocked_request

from frontend_proc.engine_client import EngineClient
from frontend_proc.errors import APIError
from frontend_proc.fanout import FanOut
from frontend_proc.serving_common import ChoiceState, StreamWriter
from pegainfer.protocol import (
    RequestRejected,
    SamplingParams,
    TextDelta,
    TextOutputs,
    TokenizedRequest,
    pack_ids,
)
from tests.fake_engine import BOOM, HANG, FakeEngine


def delta(request_id: str, text: str, finish: str | None = None) -> TextDelta:
    return TextDelta(request_id, text, pack_ids([5]), finish, None, 3, 1, 0)


def request(request_id: str) -> TokenizedRequest:
    return TokenizedRequest(request_id, pack_ids([1, 2, 3]), SamplingParams(max_tokens=2), 1.0)


def scripted_engine(script: Callable[[str], list]) -> FakeEngine:
    """The HTTP tests' fake engine, scripted by request id."""
    return FakeEngine(lambda req: script(req.request_id))


async def drain(fan: FanOut) -> list[tuple[int, str]]:
    return [(index, item.text) async for index, item in fan]


@pytest.mark.parametrize("num_requests", [1, 2])
def test_finished_requests_are_not_aborted(num_requests: int) -> None:
    engine = scripted_engine(lambda rid: [delta(rid, "a"), delta(rid, "b", "length")])
    ids = [f"r{i}" for i in range(num_requests)]

    async def main() -> None:
        tasks_before = len(asyncio.all_tasks())
        async with FanOut(engine, [request(i) for i in ids]) as fan:
            got = []
            async for index, item in fan:
                if num_requests == 1:  # read in this task: no other one was started
                    assert len(asyncio.all_tasks()) == tasks_before
                got.append((index, item.text))
        assert sorted(got) == sorted((i, t) for i in range(num_requests) for t in "ab")
        assert engine.aborted == [] and engine.active == set()

    asyncio.run(main())


@pytest.mark.parametrize("num_requests", [1, 2])
def test_a_consumer_that_leaves_early_aborts_and_closes(num_requests: int) -> None:
    engine = scripted_engine(lambda rid: [delta(rid, "a"), HANG])
    ids = [f"r{i}" for i in range(num_requests)]

    async def main() -> None:
        async with FanOut(engine, [request(i) for i in ids]) as fan:
            async for _ in fan:
                break
        assert sorted(engine.aborted) == ids and engine.active == set()

    asyncio.run(main())


@pytest.mark.parametrize("num_requests", [1, 2])
def test_a_cancelled_consumer_aborts_and_closes(num_requests: int) -> None:
    engine = scripted_engine(lambda rid: [HANG])
    ids = [f"r{i}" for i in range(num_requests)]

    async def consume() -> None:
        async with FanOut(engine, [request(i) for i in ids]) as fan:
            await drain(fan)

    async def main() -> None:
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sorted(engine.aborted) == ids and engine.active == set()

    asyncio.run(main())


def test_a_rejection_raises_as_is_and_is_not_aborted() -> None:
    rejection = RequestRejected("r0", 400, "too long", "invalid_request_error", "prompt", None)
    engine = scripted_engine(lambda rid: [rejection])

    async def main() -> None:
        with pytest.raises(APIError) as info:
            async with FanOut(engine, [request("r0")]) as fan:
                await drain(fan)
        assert (info.value.status, info.value.message, info.value.param) == (
            400,
            "too long",
            "prompt",
        )
        assert engine.aborted == [] and engine.active == set()

    asyncio.run(main())


@pytest.mark.parametrize("num_requests", [1, 2])
def test_an_engine_bug_is_a_500_and_is_not_aborted(num_requests: int) -> None:
    engine = scripted_engine(lambda rid: [BOOM] if rid == "r0" else [delta(rid, "x", "stop")])
    ids = [f"r{i}" for i in range(num_requests)]

    async def main() -> None:
        with pytest.raises(APIError) as info:
            async with FanOut(engine, [request(i) for i in ids]) as fan:
                await drain(fan)
        assert (info.value.status, info.value.message) == (500, "internal error: RuntimeError")
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "r0" not in engine.aborted and engine.active == set()

    asyncio.run(main())


def test_metrics_and_the_first_token_line_wait_for_the_consumer(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="frontend_proc.engine_client")

    async def main() -> None:
        engine = EngineClient(str(tmp_path))
        try:
            metrics = engine.metrics
            stream = engine.generate(request("r0"))
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)  # sent, waiting for output
            engine.dispatch(TextOutputs([delta("r0", "hi", "length")]))
            assert (await first).text == "hi"
            # Handed to the consumer, not yet accounted for.
            assert metrics.time_to_first_token.count == 0
            assert "first token of request r0" not in caplog.text
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
            assert metrics.time_to_first_token.count == 1
            assert metrics.e2e_request_latency.count == 1
            assert metrics.finished == {"length": 1}
            assert "first token of request r0" not in caplog.text  # queued behind the loop
            await asyncio.sleep(0)
            assert "first token of request r0: ttft" in caplog.text

            # A consumer that closes the stream at the delta still gets it counted.
            stream = engine.generate(request("r1"))
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)
            engine.dispatch(TextOutputs([delta("r1", "x")]))
            await first
            await stream.aclose()
            assert metrics.time_to_first_token.count == 2 and engine.num_active == 0
        finally:
            await engine.close()

    asyncio.run(main())


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, chunks) -> None:
        self.write(b"".join(chunks))

    def is_closing(self) -> bool:
        return False


async def stream_response(events: list[TextDelta]) -> list[bytes]:
    """Run the SSE stream driver over these events; the transport's writes, in order."""
    transport = RecordingTransport()
    protocol = mock.Mock(transport=transport, ssl_context=None, peername=None, _paused=False)
    writer = HttpStreamWriter(protocol, asyncio.get_running_loop())
    http_request = make_mocked_request(
        "POST", "/v1/completions", writer=writer, protocol=protocol, transport=transport
    )
    engine = scripted_engine(lambda rid: events)

    def chunk_for(index: int, item: TextDelta, state: ChoiceState) -> list[dict]:
        return [{"text": item.text}] if item.text else []

    async with FanOut(engine, [request("r0")]) as fan:
        await StreamWriter(http_request, fan, [ChoiceState()], chunk_for).run()
    return transport.writes


def chunked(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


@pytest.mark.skipif(
    not hasattr(web.StreamResponse, "_send_headers_immediately"),
    reason="this aiohttp sends the headers at once",
)
def test_the_headers_leave_with_the_first_event() -> None:
    writes = asyncio.run(stream_response([delta("r0", "hi"), delta("r0", "!", "stop")]))
    head, body = writes[0].split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: text/event-stream" in head and b"Transfer-Encoding: chunked" in head
    assert body == chunked(b'data: {"text":"hi"}\n\n')
    assert b"".join(writes[1:]) == (
        chunked(b'data: {"text":"!"}\n\n') + chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    )


def test_the_headers_leave_after_a_first_event_without_bytes() -> None:
    # An empty delta (half a character) writes nothing: the headers go out on their own,
    # no later than they always did.
    writes = asyncio.run(stream_response([delta("r0", ""), delta("r0", "é", "stop")]))
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"\r\n\r\n")
    assert writes[1] == chunked('data: {"text":"é"}\n\n'.encode())
