"""A fake engine behind the real HTTP app, and helpers to drive it: scripted text deltas,
hangs and faults per request, SSE parsing and OpenAI error-body checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp.test_utils import TestClient, TestServer

from frontend_proc.app import create_app
from frontend_proc.errors import APIError
from pegainfer.config import EngineConfig
from pegainfer.protocol import GenerateRequest, RequestRejected, TextDelta

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
