"""The HTTP layer against a fake engine: response shapes, SSE framing, usage arithmetic,
errors as OpenAI bodies, and aborts when a client goes away."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
from aiohttp.test_utils import TestClient, TestServer

from frontend_proc.app import create_app
from frontend_proc.errors import APIError
from pegainfer.config import EngineConfig
from pegainfer.protocol import GenerateRequest, RequestRejected, TextDelta, unpack_ids

MODEL = "tiny-model"
HANG = "hang"  # a script item: wait forever, like a request still generating
BOOM = "boom"  # a script item: raise an unexpected exception


def delta(request_id, text, finish=None, prompt_tokens=3, completion_tokens=1, stop_reason=None):
    return TextDelta(
        request_id=request_id,
        text=text,
        token_ids=b"",
        finish_reason=finish,
        stop_reason=stop_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=1,
    )


def default_script(request: GenerateRequest) -> list:
    """Each choice says its id's suffix; prompt i has 3 + i tokens, every choice 2 tokens."""
    k = request.request_id.rsplit("-", 1)[1]
    prompt_tokens = 3 + (len(request.prompt) if request.prompt else 0)
    return [
        delta(request.request_id, f"c{k}", None, prompt_tokens, 1),
        delta(request.request_id, "", None, prompt_tokens, 1),  # empty: not sent
        delta(request.request_id, "!", "length", prompt_tokens, 2),
    ]


class FakeEngine:
    def __init__(self, script: Callable[[GenerateRequest], list] = default_script) -> None:
        self.script = script
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.active: set[str] = set()

    async def generate(self, request: GenerateRequest):
        self.requests.append(request)
        self.active.add(request.request_id)
        try:
            for item in self.script(request):
                await asyncio.sleep(0.001)
                if item == HANG:
                    await asyncio.Event().wait()
                if item == BOOM:
                    raise RuntimeError("engine bug")
                if isinstance(item, RequestRejected):
                    raise APIError.from_rejection(item)
                yield item
        finally:
            self.active.discard(request.request_id)

    def abort(self, request_ids: list[str]) -> None:
        self.aborted.extend(request_ids)


def config() -> EngineConfig:
    return EngineConfig(model_path="/models/tiny", served_model_name=MODEL, max_model_len=64)


def run_with_client(
    engine: FakeEngine, body: Callable[[TestClient], object], **extra: object
) -> None:
    async def main() -> None:
        cfg = config()
        cfg.extra.update(extra)
        async with TestClient(TestServer(create_app(cfg, engine))) as client:
            await body(client)

    asyncio.run(main())


def sse_events(raw: str) -> list:
    """Split an SSE body into its data payloads, checking the framing on the way."""
    assert raw.endswith("data: [DONE]\n\n"), raw[-200:]
    blocks = raw.split("\n\n")
    assert blocks[-1] == ""
    events = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    return events[:-1]


def assert_error(body: dict, error_type: str | None = None, param: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if error_type is not None:
        assert body["error"]["type"] == error_type
    if param is not None:
        assert body["error"]["param"] == param


def test_health_and_models():
    async def body(client):
        resp = await client.get("/health")
        assert resp.status == 200
        resp = await client.get("/v1/models")
        assert resp.status == 200
        models = await resp.json()
        assert models["object"] == "list"
        (model,) = models["data"]
        assert model["id"] == MODEL and model["object"] == "model"
        assert model["owned_by"] == "pegainfer" and model["root"] == "/models/tiny"
        assert model["max_model_len"] == 64 and isinstance(model["created"], int)

    run_with_client(FakeEngine(), body)


def test_completion_batch_times_n_indices_and_usage():
    engine = FakeEngine()

    async def body(client):
        resp = await client.post(
            "/v1/completions", json={"prompt": ["ab", "abcd"], "n": 2, "max_tokens": 5, "seed": 7}
        )
        assert resp.status == 200, await resp.text()
        out = await resp.json()
        assert out["object"] == "text_completion" and out["model"] == MODEL
        assert out["id"].startswith("cmpl-") and isinstance(out["created"], int)
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in out["choices"]] == ["c0!", "c1!", "c2!", "c3!"]
        for choice in out["choices"]:
            assert choice["finish_reason"] == "length" and choice["logprobs"] is None
            assert "stop_reason" in choice
        # Each prompt counts once (5 + 7 tokens); completions count per choice (4 x 2).
        assert out["usage"] == {
            "prompt_tokens": 12,
            "completion_tokens": 8,
            "total_tokens": 20,
            "prompt_tokens_details": {"cached_tokens": 2},
        }
        ids = [r.request_id for r in engine.requests]
        assert sorted(ids) == [f"{out['id']}-{i}" for i in range(4)]
        by_id = {r.request_id: r for r in engine.requests}
        assert by_id[f"{out['id']}-2"].prompt == "abcd"
        # n samples of one prompt get distinct seeds.
        assert [by_id[f"{out['id']}-{i}"].sampling.seed for i in range(4)] == [7, 8, 7, 8]
        assert all(r.sampling.max_tokens == 5 for r in engine.requests)
        assert engine.aborted == [] and engine.active == set()

    run_with_client(engine, body)


def test_completion_token_prompt_and_echo():
    engine = FakeEngine()

    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": [[1, 2, 3]], "model": MODEL})
        assert resp.status == 200
        (request,) = engine.requests
        assert request.prompt is None and unpack_ids(request.prompt_token_ids) == [1, 2, 3]
        resp = await client.post("/v1/completions", json={"prompt": "Say", "echo": True})
        assert (await resp.json())["choices"][0]["text"] == "Sayc0!"

    run_with_client(engine, body)


def test_completion_stream_framing_and_include_usage():
    async def body(client):
        resp = await client.post(
            "/v1/completions",
            json={"prompt": "x", "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
        assert last["usage"]["prompt_tokens"] == 4  # one prompt of 4 tokens, counted once
        for chunk in chunks:
            assert chunk["object"] == "text_completion" and chunk["usage"] is None
            (choice,) = chunk["choices"]
            assert choice["logprobs"] is None
        texts = {0: "", 1: ""}
        finishes = {}
        for chunk in chunks:
            choice = chunk["choices"][0]
            assert choice["text"] or choice["finish_reason"]  # no empty chunks
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
        assert texts == {0: "c0!", 1: "c1!"} and finishes == {0: "length", 1: "length"}
        assert len({chunk["id"] for chunk in events}) == 1

    run_with_client(FakeEngine(), body)


def test_completion_stream_without_usage_has_no_usage_field():
    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
        events = sse_events(await resp.text())
        assert events and all("usage" not in event for event in events)

    run_with_client(FakeEngine(), body)


def test_chat_completion_shape():
    engine = FakeEngine()

    async def body(client):
        messages = [{"role": "user", "content": "hi"}]
        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "n": 2, "chat_template_kwargs": {"enable_thinking": False}},
        )
        assert resp.status == 200, await resp.text()
        out = await resp.json()
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert out["choices"][1]["message"] == {
            "role": "assistant",
            "content": "c1!",
            "reasoning_content": None,
        }
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["prompt_tokens"] == 3 and out["usage"]["completion_tokens"] == 4
        request = engine.requests[0]
        assert request.messages == messages and request.add_generation_prompt is True
        assert request.chat_template_kwargs == {"enable_thinking": False}
        assert request.sampling.max_tokens == -1  # resolved by the tokenizer

    run_with_client(engine, body)


def test_chat_stream_role_then_content_then_finish():
    async def body(client):
        resp = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events = sse_events(await resp.text())
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        deltas = [e["choices"][0]["delta"] for e in events[:-1]]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[1] == {"content": "c0"}
        assert deltas[2] == {"content": "!"}
        assert events[2]["choices"][0]["finish_reason"] == "length"
        assert [e["choices"][0]["finish_reason"] for e in events[:2]] == [None, None]
        assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 5

    run_with_client(FakeEngine(), body)


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
