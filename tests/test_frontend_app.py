"""The HTTP layer against a fake engine: response shapes, SSE framing and usage arithmetic.
Errors, rejections and disconnects are tests/test_frontend_errors.py's."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend_proc.app import create_app
from pegainfer.cli import build_parser, config_from_args
from pegainfer.protocol import unpack_ids
from tests.fake_engine import MODEL, FakeEngine, config, run_with_client, sse_events


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


def test_completion_stream_echo_starts_each_choices_first_chunk():
    async def body(client):
        resp = await client.post(
            "/v1/completions",
            json={"prompt": ["Say", "Tell"], "n": 2, "echo": True, "stream": True},
        )
        texts: dict[int, list[str]] = {}
        for event in sse_events(await resp.text()):
            (choice,) = event["choices"]
            texts.setdefault(choice["index"], []).append(choice["text"])
        assert texts == {
            0: ["Sayc0", "!"],
            1: ["Sayc1", "!"],
            2: ["Tellc2", "!"],
            3: ["Tellc3", "!"],
        }

    run_with_client(FakeEngine(), body)


def test_continuous_usage_stats_count_each_choice_in_every_chunk():
    options = {"include_usage": True, "continuous_usage_stats": True}

    async def body(client):
        resp = await client.post(
            "/v1/completions",
            json={"prompt": "x", "n": 2, "stream": True, "stream_options": options},
        )
        *chunks, last = sse_events(await resp.text())
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
        counts = {}
        for chunk in chunks:
            counts.setdefault(chunk["choices"][0]["index"], []).append(chunk["usage"])
        for index in (0, 1):
            assert [u["completion_tokens"] for u in counts[index]] == [1, 2]
            for usage in counts[index]:
                assert usage["prompt_tokens"] == 4
                assert usage["total_tokens"] == 4 + usage["completion_tokens"]

        messages = [{"role": "user", "content": "hi"}]
        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "stream": True, "stream_options": options},
        )
        *chunks, last = sse_events(await resp.text())
        assert [chunk["usage"] for chunk in chunks] == [
            {"prompt_tokens": 3, "completion_tokens": c, "total_tokens": 3 + c} for c in (0, 1, 2)
        ]
        assert last["usage"]["total_tokens"] == 5
        # Without include_usage the option asks nothing, as in vLLM.
        options_alone = {"continuous_usage_stats": True}
        resp = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "stream": True, "stream_options": options_alone},
        )
        assert all("usage" not in event for event in sse_events(await resp.text()))

    run_with_client(FakeEngine(), body)


def test_a_model_served_under_several_names_answers_to_each():
    async def body(client):
        models = await (await client.get("/v1/models")).json()
        assert [card["id"] for card in models["data"]] == [MODEL, "alias"]
        assert (await client.get("/v1/models/alias")).status == 200
        for name in (MODEL, "alias"):
            resp = await client.post("/v1/completions", json={"prompt": "x", "model": name})
            assert resp.status == 200 and (await resp.json())["model"] == name
        resp = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})  # fmt: skip
        assert (await resp.json())["model"] == MODEL  # no name given: the first
        resp = await client.post("/v1/completions", json={"prompt": "x", "model": "other"})
        assert resp.status == 404

    async def main() -> None:
        cfg = config()
        cfg.served_model_aliases = ["alias"]
        async with TestClient(TestServer(create_app(cfg, FakeEngine()))) as client:
            await body(client)

    asyncio.run(main())
    args = build_parser().parse_args(["--served-model-name", "qwen3", "Qwen/Qwen3-4B"])
    cfg = config_from_args(args)
    assert (cfg.served_model_name, cfg.served_model_aliases) == ("qwen3", ["Qwen/Qwen3-4B"])
    with pytest.raises(SystemExit, match="give the model first"):
        config_from_args(build_parser().parse_args(["--served-model-name", "a", "/"]))


def test_chat_echo_opens_the_answer_with_the_assistants_last_message():
    messages = [{"role": "user", "content": "Tell"}, {"role": "assistant", "content": "Once"}]
    going_on = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}

    async def body(client):
        resp = await client.post("/v1/chat/completions", json={"messages": messages, **going_on})
        assert (await resp.json())["choices"][0]["message"]["content"] == "Oncec0!"
        resp = await client.post(
            "/v1/chat/completions", json={"messages": messages, "stream": True, **going_on}
        )
        deltas = [e["choices"][0]["delta"] for e in sse_events(await resp.text())]
        assert [d.get("content") for d in deltas] == ["", "Oncec0", "!"]
        # The last message is the user's: nothing to echo.
        resp = await client.post(
            "/v1/chat/completions", json={"messages": messages[:1], "echo": True}
        )
        assert (await resp.json())["choices"][0]["message"]["content"] == "c0!"

    run_with_client(FakeEngine(), body)
