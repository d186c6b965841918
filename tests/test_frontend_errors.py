"""The HTTP layer against a fake engine when things go wrong: errors as OpenAI bodies,
rejections before and after a stream starts, engine faults, and aborts when a client goes
away."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import pytest

from frontend_proc import jsonutil
from pegainfer.protocol import RequestRejected
from tests.fake_engine import (
    BOOM,
    HANG,
    FakeEngine,
    assert_error,
    default_script,
    delta,
    run_with_client,
    sse_events,
)


def test_errors_are_openai_bodies():
    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"})
        assert resp.status == 404
        out = await resp.json()
        assert_error(out, param="model")
        assert out["error"]["code"] == "model_not_found"

        resp = await client.get("/v1/nothing")
        assert resp.status == 404
        assert_error(await resp.json(), "invalid_request_error")

        resp = await client.get("/v1/completions")
        assert resp.status == 405
        assert_error(await resp.json())

        resp = await client.post("/v1/completions", data=b"{not json")
        assert resp.status == 400
        assert_error(await resp.json(), "invalid_request_error")

        resp = await client.post("/v1/completions", data=b"")
        assert resp.status == 400

        resp = await client.post("/v1/chat/completions", json=[1, 2])
        assert resp.status == 400

        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": "ten"})
        assert resp.status == 400
        assert_error(await resp.json(), "invalid_request_error", "max_tokens")

        resp = await client.post("/v1/chat/completions", json={"messages": "hi"})
        assert resp.status == 400
        assert_error(await resp.json(), param="messages")

    run_with_client(FakeEngine(), body)


@pytest.mark.parametrize("parser", ["installed", "json"])
def test_lone_surrogates_and_deep_nesting_are_a_400_and_pairs_are_text(parser, monkeypatch):
    if parser == "json":
        monkeypatch.setattr(jsonutil, "orjson", None)
    engine = FakeEngine()

    async def body(client):
        for raw in (
            b'{"prompt": "Hi \\ud800", "max_tokens": 3}',
            b'{"prompt": "\\udc00", "max_tokens": 3}',
            b'{"prompt": "Hi", "stop": ["\\ud83d"], "max_tokens": 3}',
            b'{"prompt": "Hi \xed\xa0\x80", "max_tokens": 3}',  # an encoded surrogate
        ):
            resp = await client.post("/v1/completions", data=raw)
            assert resp.status == 400, raw
            assert_error(await resp.json(), "invalid_request_error")
        deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b', "max_tokens": 3}'
        resp = await client.post("/v1/completions", data=deep)
        assert resp.status == 400
        assert_error(await resp.json(), "invalid_request_error")
        chat = b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}'
        resp = await client.post("/v1/chat/completions", data=chat)
        assert resp.status == 400
        assert_error(await resp.json(), "invalid_request_error")
        assert not engine.requests
        # A surrogate pair is one character (U+1F600), and the request goes through.
        emoji = b'{"prompt": "Hi \\ud83d\\ude00", "max_tokens": 3}'
        resp = await client.post("/v1/completions", data=emoji)
        assert resp.status == 200
        assert engine.requests[-1].prompt == "Hi \U0001f600"

    run_with_client(engine, body)


def test_json_fallback_names_where_the_lone_surrogate_is(monkeypatch):
    monkeypatch.setattr(jsonutil, "orjson", None)
    with pytest.raises(ValueError, match=r"at messages\[1\]\.content .*U\+D800"):
        jsonutil.loads(b'{"messages": [{"content": "ok"}, {"content": "a\\ud800"}]}')
    with pytest.raises(ValueError, match="lone surrogate"):
        jsonutil.loads('{"\\udfff": 1}')  # a key, and a str body
    assert jsonutil.loads(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash
    assert jsonutil.loads(b'[1, "\\u00e9"]') == [1, "\u00e9"]


def rejection(request_id: str) -> RequestRejected:
    return RequestRejected(
        request_id, 400, "too long", "invalid_request_error", "prompt", "context_length_exceeded"
    )


def test_rejected_request_returns_its_status_and_body():
    engine = FakeEngine(lambda r: [rejection(r.request_id)])

    async def body(client):
        for stream in (False, True):
            resp = await client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert resp.status == 400
            out = await resp.json()
            assert out["error"] == {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "prompt",
                "code": "context_length_exceeded",
            }

    run_with_client(engine, body)


def test_rejection_after_stream_started_is_an_error_event_and_others_are_aborted():
    def script(request):
        if request.request_id.endswith("-1"):
            return [delta(request.request_id, "x"), HANG]
        return [delta(request.request_id, "a"), rejection(request.request_id)]

    engine = FakeEngine(script)

    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "p", "n": 2, "stream": True})
        assert resp.status == 200
        events = sse_events(await resp.text())
        assert events[-1]["error"]["code"] == "context_length_exceeded"
        assert [e for e in events if "error" in e] == [events[-1]]
        # The rejected one holds nothing; the still-running sibling must be aborted.
        assert len(engine.aborted) == 1 and engine.aborted[0].endswith("-1")
        assert engine.active == set()

    run_with_client(engine, body)


def test_unexpected_exception_is_a_500_and_the_server_keeps_going():
    calls = []

    def script(request):
        calls.append(request)
        if len(calls) == 1:
            return [BOOM]
        return default_script(request)

    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 500
        assert_error(await resp.json(), "server_error")
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 200

    run_with_client(FakeEngine(script), body)


async def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_streaming_disconnect_aborts_unfinished_requests():
    def script(request):
        if request.request_id.endswith("-0"):
            return [delta(request.request_id, "done", "stop")]
        return [delta(request.request_id, "tok"), HANG]

    engine = FakeEngine(script)

    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "p", "n": 3, "stream": True})
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the stream has started
        resp.close()  # the client goes away
        await wait_for(lambda: len(engine.aborted) == 2)
        await wait_for(lambda: not engine.active)
        # The finished choice is not aborted; the two still running are.
        assert sorted(i.rsplit("-", 1)[1] for i in engine.aborted) == ["1", "2"]

    run_with_client(engine, body)


def test_non_streaming_disconnect_aborts():
    engine = FakeEngine(lambda r: [delta(r.request_id, "tok"), HANG])

    async def body(client):
        request = asyncio.ensure_future(
            client.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
        )
        await wait_for(lambda: len(engine.requests) == 1)
        request.cancel()  # closes the connection; the server cancels the handler
        try:
            await request
        except (asyncio.CancelledError, aiohttp.ClientError):
            pass
        await wait_for(lambda: engine.aborted == [engine.requests[0].request_id])
        await wait_for(lambda: not engine.active)

    run_with_client(engine, body)


def test_oversized_body_is_a_413_error_body():
    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "x" * 5000})
        assert resp.status == 413
        out = await resp.json()
        assert_error(out, "invalid_request_error")
        assert "1000" in out["error"]["message"]
        # A chunked body has no Content-Length: the limit holds while it is read.

        async def chunks():
            for _ in range(5):
                yield b"x" * 400

        resp = await client.post("/v1/completions", data=chunks())
        assert resp.status == 413
        assert "1000" in (await resp.json())["error"]["message"]

    run_with_client(FakeEngine(), body, max_request_bytes=1000)
