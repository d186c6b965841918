"""vLLM's request extensions: ``allowed_token_ids`` (the worker keeps only those logits),
``truncate_prompt_tokens`` (the tokenizer process, or the frontend for token-id prompts,
keeps the prompt's tail), ``include_reasoning`` and ``priority``.
``cache_salt`` is in test_prefix_cache.py, ``bad_words`` in test_bad_words.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from test_tokenizer_proc import VOCAB, preprocessor, request  # noqa: F401 - a fixture

from frontend_proc.app import create_app
from frontend_proc.engine_extras import parse_engine_extras, truncate_prompt
from frontend_proc.errors import APIError
from frontend_proc.preprocess import handle
from frontend_proc.schemas import parse_chat_request, parse_completion_request
from frontend_proc.serving_common import ServingContext
from frontend_proc.serving_completions import checked_id_prompt
from pegainfer.protocol import RequestRejected, SamplingParams, pack_ids, unpack_ids
from tests.fake_engine import MODEL, FakeEngine, config, delta
from worker_proc.logit_edits import keep_only_edits
from worker_proc.sampler import Sampler
from worker_proc.upload import Uploader

CPU = torch.device("cpu")

# -- the fields ----------------------------------------------------------------------------


def test_the_extensions_are_read_into_the_request() -> None:
    body = {
        "prompt": "hi",
        "allowed_token_ids": [9, 3, 9],
        "truncate_prompt_tokens": 5,
        "cache_salt": "tenant-7",
        "priority": -3,
        "bad_words": ["spam", "eggs"],
    }
    request = parse_completion_request(body, MODEL)
    assert request.sampling.allowed_token_ids == [3, 9]
    assert request.sampling.cache_salt == "tenant-7"
    assert request.truncate_prompt_tokens == 5
    assert request.sampling.bad_words == ["spam", "eggs"] and request.sampling.priority == -3
    chat = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **body}, MODEL)
    assert chat.truncate_prompt_tokens == 5 and chat.include_reasoning
    body = {"messages": [{"role": "user", "content": "hi"}], "include_reasoning": False}
    assert not parse_chat_request(body, MODEL).include_reasoning


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("bad_words", "spam", "list of strings"),
        ("priority", 1.5, "integer"),
        ("allowed_token_ids", [], "must not be empty"),
        ("allowed_token_ids", [-1], "outside"),
        ("truncate_prompt_tokens", 0, "at least 1"),
        ("truncate_prompt_tokens", -2, "-1"),
        ("cache_salt", "", "must not be empty"),
        ("cache_salt", 7, "string"),
    ],
)
def test_bad_or_unsupported_extensions_are_400s_naming_the_field(field, value, words) -> None:
    with pytest.raises(APIError) as refused:
        parse_engine_extras({field: value})
    assert refused.value.status == 400 and refused.value.param == field
    assert words in refused.value.message


def test_echo_and_truncation_together_are_refused() -> None:
    body = {"prompt": "hi", "echo": True, "truncate_prompt_tokens": 2}
    with pytest.raises(APIError, match="echo"):
        parse_completion_request(body, MODEL)


# -- truncation ----------------------------------------------------------------------------


def test_truncation_keeps_the_prompts_tail() -> None:
    packed = pack_ids([1, 2, 3, 4, 5])
    assert unpack_ids(truncate_prompt(packed, 2, 16)) == [4, 5]
    assert truncate_prompt(packed, 9, 16) == packed
    assert truncate_prompt(packed, None, 16) == packed
    assert unpack_ids(truncate_prompt(packed, -1, 3)) == [3, 4, 5]
    with pytest.raises(APIError, match="exceeds the context"):
        truncate_prompt(packed, 17, 16)


def test_the_tokenizer_process_truncates_text_chat_and_ids(preprocessor) -> None:  # noqa: F811
    out = preprocessor.process(request(prompt="hello world the cat", truncate_prompt_tokens=2))
    assert unpack_ids(out.prompt_token_ids) == [VOCAB["the"], VOCAB["cat"]]
    chat = request(messages=[{"role": "user", "content": "the cat"}], truncate_prompt_tokens=3)
    out = preprocessor.process(chat)
    assert unpack_ids(out.prompt_token_ids) == [VOCAB["cat"], VOCAB["</s>"], VOCAB["<|assistant|>"]]
    # -1: the context's length (16 here), so a prompt of 20 tokens keeps its last 16, and
    # max_tokens (4) no longer fits.
    ids = pack_ids(list(range(5, 9)) * 5)
    outcome = handle(preprocessor, request(prompt_token_ids=ids, truncate_prompt_tokens=-1))
    assert isinstance(outcome, RequestRejected) and "context length" in outcome.message
    sampling = SamplingParams(max_tokens=4)
    out = preprocessor.process(
        request(prompt_token_ids=ids, truncate_prompt_tokens=12, sampling=sampling)
    )
    assert len(unpack_ids(out.prompt_token_ids)) == 12


def test_the_frontend_truncates_a_token_id_prompt_it_sends_directly() -> None:
    request = parse_completion_request(
        {"prompt": [5, 6, 7, 8], "truncate_prompt_tokens": 3, "max_tokens": 2}, MODEL
    )
    ctx = ServingContext(MODEL, "/models/tiny", 16, engine=None, vocab_size=10)
    prompt, sampling = checked_id_prompt(request.prompts[0], request, ctx)
    assert unpack_ids(prompt) == [6, 7, 8] and sampling.max_tokens == 2


# -- allowed_token_ids on the worker -------------------------------------------------------


def test_only_the_allowed_tokens_keep_their_logits() -> None:
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[2, 7]), SamplingParams(allowed_token_ids=[0])]  # fmt: skip
    edit = keep_only_edits(params, Uploader(CPU))
    assert edit is not None and keep_only_edits([SamplingParams()], Uploader(CPU)) is None
    logits = torch.randn(3, 10)
    expected = logits.clone()
    expected[1, [0, 1, 3, 4, 5, 6, 8, 9]] = float("-inf")
    expected[2, 1:] = float("-inf")
    edit.apply(logits)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_sampler_draws_only_allowed_token_ids(temperature) -> None:
    sampler = Sampler(CPU)
    allowed = [[3, 17, 250], [0]]
    params = [SamplingParams(temperature=temperature, allowed_token_ids=ids) for ids in allowed]
    params.append(SamplingParams(temperature=temperature))
    batch = sampler.prepare(params, 300)
    for draw in range(20):
        logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(draw))
        tokens = sampler.sample(logits, batch).tolist()
        assert tokens[0] in allowed[0] and tokens[1] == 0
        if temperature == 0.0:
            assert tokens[0] == allowed[0][int(logits[0, allowed[0]].argmax())]
            assert tokens[2] == int(logits[2].argmax())


# -- include_reasoning ---------------------------------------------------------------------


def thinking_script(request):
    pieces = ["<think>\nLet me", " see.\n</think>\n\n", "Paris."]
    return [delta(request.request_id, text) for text in pieces[:-1]] + [
        delta(request.request_id, pieces[-1], "stop", completion_tokens=9)
    ]


def test_without_reasoning_the_answer_is_the_content_alone() -> None:
    answers = {}

    async def main() -> None:
        app = create_app(config(), FakeEngine(thinking_script), reasoning=True)
        async with TestClient(TestServer(app)) as client:
            for include in (True, False):
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Capital?"}]}
                body["include_reasoning"] = include
                response = await client.post("/v1/chat/completions", json=body)
                answers[include] = (await response.json())["choices"][0]["message"]
                response = await client.post("/v1/chat/completions", json={**body, "stream": True})
                text = await response.text()
                chunks = [
                    json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")
                ]
                answers[include, "stream"] = [
                    c["choices"][0]["delta"] for c in chunks if c["choices"]
                ]

    asyncio.run(main())
    assert answers[True]["reasoning_content"] == "\nLet me see.\n"
    assert answers[False]["reasoning_content"] is None
    for include in (True, False):
        assert answers[include]["content"] == "\n\nParis."
        streamed = answers[include, "stream"]
        assert "".join(d.get("content") or "" for d in streamed) == "\n\nParis."
        reasoning = "".join(d.get("reasoning_content") or "" for d in streamed)
        assert reasoning == ("\nLet me see.\n" if include else "")


# -- return_tokens_as_token_ids ------------------------------------------------------------


def test_logprobs_may_name_tokens_by_id() -> None:
    from frontend_proc.logprobs import TokenEntry, chat_logprobs, completion_logprobs

    tokens = [
        TokenEntry(7, b"ab", -0.5, [(7, b"ab", -0.5), (9, b"\xe4", -1.0)]),
        TokenEntry(3, b"c", -0.1, []),
    ]
    legacy = completion_logprobs(tokens, 2, 10, as_token_ids=True)
    assert legacy["tokens"] == ["token_id:7", "token_id:3"]
    assert legacy["text_offset"] == [10, 12]  # the text's own lengths
    assert legacy["top_logprobs"][0] == {"token_id:7": -0.5, "token_id:9": -1.0}
    chat = chat_logprobs(tokens, 2, as_token_ids=True)["content"]
    assert [c["token"] for c in chat] == ["token_id:7", "token_id:3"]
    assert chat[0]["bytes"] == [97, 98] and chat[0]["top_logprobs"][1]["token"] == "token_id:9"
    assert completion_logprobs(tokens, 2)["tokens"] == ["ab", "c"]
    request = parse_completion_request({"prompt": "x", "return_tokens_as_token_ids": True}, MODEL)
    assert request.return_tokens_as_token_ids
