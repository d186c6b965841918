"""vLLM's ``prompt_logprobs`` and ``add_special_tokens`` request fields: their checks, and
the response's shape (the real tree's prompt logprobs against transformers are in
tests/test_api_endpoints.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from frontend_proc.app import create_app
from frontend_proc.errors import APIError
from frontend_proc.fields import MAX_INT32
from frontend_proc.logprobs import TokenEntry, prompt_logprobs_field
from frontend_proc.schemas import parse_chat_request, parse_completion_request
from pegainfer.cli import build_parser, config_from_args
from tests.fake_engine import FakeEngine, config, run_with_client

MODEL = "m"


def completion(**fields):
    return parse_completion_request({"prompt": "hi", **fields}, MODEL)


def chat(**fields):
    return parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields}, MODEL)


@pytest.mark.parametrize("parse", [completion, chat])
def test_prompt_logprobs_reach_the_sampling_settings(parse):
    for count in (0, 5, 20):
        request = parse(prompt_logprobs=count)
        assert request.prompt_logprobs == request.sampling.prompt_logprobs == count
    request = parse()
    assert request.prompt_logprobs is None and request.sampling.prompt_logprobs is None


@pytest.mark.parametrize("parse", [completion, chat])
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_logprobs": 21}, "at most 20"),
        ({"prompt_logprobs": -1}, "whole vocabulary"),
        ({"prompt_logprobs": -2}, "at least 0"),
        ({"prompt_logprobs": "3"}, "must be an integer"),
        ({"prompt_logprobs": True}, "must be an integer"),
        ({"prompt_logprobs": 1, "stream": True}, "not available when 'stream' is true"),
    ],
)
def test_bad_prompt_logprobs_are_a_400_naming_the_field(parse, fields, message):
    with pytest.raises(APIError) as caught:
        parse(**fields)
    assert caught.value.status == 400 and caught.value.param == "prompt_logprobs"
    assert message in caught.value.message


@pytest.mark.parametrize("parse", [completion, chat])
def test_zero_prompt_logprobs_in_a_stream_ask_for_nothing(parse):
    # As vLLM accepts it: a stream has no place for prompt logprobs.
    request = parse(prompt_logprobs=0, stream=True)
    assert request.prompt_logprobs is None and request.sampling.prompt_logprobs is None


def test_echo_and_prompt_logprobs_share_one_computation():
    assert completion(echo=True, logprobs=1, prompt_logprobs=4).sampling.prompt_logprobs == 4
    assert completion(echo=True, logprobs=5, prompt_logprobs=2).sampling.prompt_logprobs == 5
    assert completion(echo=True, logprobs=5).sampling.prompt_logprobs == 5
    assert completion(logprobs=5, prompt_logprobs=2).sampling.prompt_logprobs == 2


def test_the_field_maps_token_ids_to_logprob_rank_and_text():
    tokens = [
        TokenEntry(7, b"A", None),
        # The prompt's token is not among the top two: three entries, its own first.
        TokenEntry(8, b" b", -4.0, [(1, b" x", -0.5), (2, b" y", -1.0), (3, b" z", -2.0)], 9),
        # It is the likeliest: two entries, its rank 1.
        TokenEntry(1, b" x", -0.25, [(1, b" x", -0.25), (4, b"\xe4", -3.0)], 1),
    ]
    assert prompt_logprobs_field(tokens, 2) == [
        None,
        {
            "8": {"logprob": -4.0, "rank": 9, "decoded_token": " b"},
            "1": {"logprob": -0.5, "rank": 1, "decoded_token": " x"},
            "2": {"logprob": -1.0, "rank": 2, "decoded_token": " y"},
        },
        {
            "1": {"logprob": -0.25, "rank": 1, "decoded_token": " x"},
            "4": {"logprob": -3.0, "rank": 2, "decoded_token": "\\xe4"},
        },
    ]
    assert list(prompt_logprobs_field(tokens, 2)[1]) == ["8", "1", "2"]
    assert prompt_logprobs_field(tokens, 0)[1] == {
        "8": {"logprob": -4.0, "rank": 9, "decoded_token": " b"}
    }


def test_add_special_tokens_is_read_on_both_endpoints():
    assert completion().add_special_tokens is None  # the tokenizer's own: BOS where it adds one
    assert completion(add_special_tokens=False).add_special_tokens is False
    assert chat().add_special_tokens is False  # the template writes them
    assert chat(add_special_tokens=True).add_special_tokens is True
    with pytest.raises(APIError, match="must be a boolean"):
        chat(add_special_tokens="yes")


def test_only_each_prompts_first_choice_computes_its_prompt_logprobs():
    engine = FakeEngine()

    async def body(client):
        for path, extra in (
            ("/v1/completions", {"prompt": ["a", "b"]}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ):
            engine.requests.clear()
            resp = await client.post(path, json={**extra, "n": 3, "prompt_logprobs": 2})
            assert resp.status == 200, await resp.text()
            asked = {
                r.request_id.rsplit("-", 1)[1]: r.sampling.prompt_logprobs for r in engine.requests
            }
            firsts = {"0", "3"} if path == "/v1/completions" else {"0"}
            assert {k for k, v in asked.items() if v is not None} == firsts
        # Echoed logprobs: every choice streams its own.
        engine.requests.clear()
        echoed = {"prompt": "a", "n": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 2}
        assert (await client.post("/v1/completions", json=echoed)).status == 200
        assert [r.sampling.prompt_logprobs for r in engine.requests] == [2, 2]

    run_with_client(engine, body)


def test_max_logprobs_sets_how_many_alternatives_a_token_may_ask_for():
    with pytest.raises(APIError, match="at most 20"):
        completion(logprobs=21)
    assert parse_completion_request({"prompt": "hi", "logprobs": 50}, MODEL, max_logprobs=50).logprobs == 50  # fmt: skip
    request = parse_chat_request(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30},
        MODEL,
        max_logprobs=30,
    )
    assert request.sampling.logprobs == 30
    # -1: the whole vocabulary, where the server allows it; the worker stops at the vocabulary.
    whole = parse_completion_request(
        {"prompt": "hi", "prompt_logprobs": -1}, MODEL, max_logprobs=-1
    )
    assert whole.sampling.prompt_logprobs == MAX_INT32
    with pytest.raises(APIError, match="at most 20 \\(--max-logprobs\\)"):
        completion(prompt_logprobs=-1)
    args = build_parser().parse_args(["--max-logprobs", "-1"])
    assert config_from_args(args).max_logprobs == -1
    with pytest.raises(SystemExit):
        config_from_args(build_parser().parse_args(["--max-logprobs", "-2"]))


def test_the_server_holds_requests_to_its_max_logprobs():
    async def body(client):
        resp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 30})
        assert resp.status == 200, await resp.text()
        resp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 31})
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "logprobs"

    async def main() -> None:
        cfg = config()
        cfg.max_logprobs = 30
        async with TestClient(TestServer(create_app(cfg, FakeEngine()))) as client:
            await body(client)

    asyncio.run(main())
