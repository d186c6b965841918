"""Request validation: every malformed body is a 400 naming the field (or a 404 for a model
this server does not serve), and valid bodies become the right SamplingParams."""

from __future__ import annotations

import pytest

from frontend_proc.errors import APIError
from frontend_proc.schemas import (
    FILL_CONTEXT,
    parse_chat_request,
    parse_completion_request,
)
from pegainfer.protocol import pack_ids

MODEL = "served-model"
CHAT = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return {"model": MODEL, "prompt": "hello", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": CHAT, **fields}


COMPLETION_ERRORS = [
    # (body, status, type, param)
    ([1, 2], 400, "invalid_request_error", None),
    ("just a string", 400, "invalid_request_error", None),
    ({"model": MODEL}, 400, "invalid_request_error", "prompt"),
    (completion(prompt=None), 400, "invalid_request_error", "prompt"),
    (completion(prompt=42), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[[]]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=["a", 1]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[1, "a"]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[[1, 2], 3]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[1, -5]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[1, 2**40]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[True, False]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[1, True]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[1, 2.0]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[1, 2**31]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[-1, 1]), 400, "invalid_request_error", "prompt"),
    (completion(prompt=[[3], [4, -(2**31)]]), 400, "invalid_request_error", "prompt"),
    (completion(prompt={"text": "x"}), 400, "invalid_request_error", "prompt"),
    (completion(max_tokens="ten"), 400, "invalid_request_error", "max_tokens"),
    (completion(max_tokens=0), 400, "invalid_request_error", "max_tokens"),
    (completion(max_tokens=-3), 400, "invalid_request_error", "max_tokens"),
    (completion(max_tokens=1.5), 400, "invalid_request_error", "max_tokens"),
    (completion(max_tokens=True), 400, "invalid_request_error", "max_tokens"),
    (completion(temperature="hot"), 400, "invalid_request_error", "temperature"),
    (completion(temperature=-0.1), 400, "invalid_request_error", "temperature"),
    (completion(temperature=2.5), 400, "invalid_request_error", "temperature"),
    (completion(temperature=float("nan")), 400, "invalid_request_error", "temperature"),
    (completion(temperature=float("inf")), 400, "invalid_request_error", "temperature"),
    (completion(top_p=0), 400, "invalid_request_error", "top_p"),
    (completion(top_p=1.01), 400, "invalid_request_error", "top_p"),
    (completion(top_k=-2), 400, "invalid_request_error", "top_k"),
    (completion(top_k="5"), 400, "invalid_request_error", "top_k"),
    (completion(min_p=1.5), 400, "invalid_request_error", "min_p"),
    (completion(n=0), 400, "invalid_request_error", "n"),
    (completion(n=1000), 400, "invalid_request_error", "n"),
    (completion(seed="abc"), 400, "invalid_request_error", "seed"),
    (completion(seed=2**70), 400, "invalid_request_error", "seed"),
    (completion(stream="yes"), 400, "invalid_request_error", "stream"),
    (
        completion(stream_options={"include_usage": True}),
        400,
        "invalid_request_error",
        "stream_options",
    ),
    (completion(stream=False, stream_options={}), 400, "invalid_request_error", "stream_options"),
    (completion(stream=True, stream_options=[1]), 400, "invalid_request_error", "stream_options"),
    (
        completion(stream=True, stream_options={"include_usage": "y"}),
        400,
        "invalid_request_error",
        "include_usage",
    ),
    (completion(stop=""), 400, "invalid_request_error", "stop"),
    (completion(stop=[]), 400, "invalid_request_error", "stop"),
    (completion(stop=["ok", ""]), 400, "invalid_request_error", "stop"),
    (completion(stop=[1]), 400, "invalid_request_error", "stop"),
    (completion(stop=5), 400, "invalid_request_error", "stop"),
    (completion(stop_token_ids=[1, "2"]), 400, "invalid_request_error", "stop_token_ids"),
    (completion(stop_token_ids=[-1]), 400, "invalid_request_error", "stop_token_ids"),
    (completion(stop_token_ids=7), 400, "invalid_request_error", "stop_token_ids"),
    (completion(ignore_eos=1), 400, "invalid_request_error", "ignore_eos"),
    (completion(min_tokens=-1), 400, "invalid_request_error", "min_tokens"),
    (completion(min_tokens=20, max_tokens=10), 400, "invalid_request_error", "min_tokens"),
    (completion(presence_penalty=3), 400, "invalid_request_error", "presence_penalty"),
    (completion(frequency_penalty=-2.5), 400, "invalid_request_error", "frequency_penalty"),
    (completion(repetition_penalty=0), 400, "invalid_request_error", "repetition_penalty"),
    (completion(echo="true"), 400, "invalid_request_error", "echo"),
    (completion(prompt=[1, 2], echo=True), 400, "invalid_request_error", "echo"),
    (completion(logprobs=21), 400, "invalid_request_error", "logprobs"),
    (completion(logprobs=-1), 400, "invalid_request_error", "logprobs"),
    (completion(logprobs=True), 400, "invalid_request_error", "logprobs"),
    (completion(user=5), 400, "invalid_request_error", "user"),
    (completion(model=7), 400, "invalid_request_error", "model"),
    (completion(model="gpt-4"), 404, "invalid_request_error", "model"),
]


@pytest.mark.parametrize(("body", "status", "error_type", "param"), COMPLETION_ERRORS)
def test_completion_errors(body, status, error_type, param):
    with pytest.raises(APIError) as info:
        parse_completion_request(body, MODEL)
    err = info.value
    assert (err.status, err.type, err.param) == (status, error_type, param), err.message
    body_json = err.body()["error"]
    assert set(body_json) == {"message", "type", "param", "code"}
    assert body_json["message"]


CHAT_ERRORS = [
    ({"model": MODEL}, 400, "messages"),
    (chat(messages="hi"), 400, "messages"),
    (chat(messages=[]), 400, "messages"),
    (chat(messages=["hi"]), 400, "messages"),
    (chat(messages=[{"content": "hi"}]), 400, "messages"),
    (chat(messages=[{"role": 1, "content": "hi"}]), 400, "messages"),
    (chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    (chat(messages=[{"role": "user"}]), 400, "messages"),
    (chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400, "messages"),
    (chat(messages=[{"role": "user", "content": ["text"]}]), 400, "messages"),
    (
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages",
    ),
    (chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400, "messages"),
    (chat(messages=[{"role": "assistant", "content": None}]), 400, "messages"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": "x"}]), 400, "messages"),
    (chat(messages=[{"role": "tool", "content": "x", "tool_call_id": 3}]), 400, "messages"),
    (chat(max_tokens="ten"), 400, "max_tokens"),
    (chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (chat(temperature="hot"), 400, "temperature"),
    (chat(logprobs=3), 400, "logprobs"),
    (chat(top_logprobs=3), 400, "top_logprobs"),
    (chat(logprobs=True, top_logprobs=25), 400, "top_logprobs"),
    (chat(chat_template_kwargs="x"), 400, "chat_template_kwargs"),
    (chat(add_generation_prompt="no"), 400, "add_generation_prompt"),
    (chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (chat(model="other"), 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), CHAT_ERRORS)
def test_chat_errors(body, status, param):
    with pytest.raises(APIError) as info:
        parse_chat_request(body, MODEL)
    assert (info.value.status, info.value.param) == (status, param), info.value.message


def test_unknown_model_error_matches_openai():
    with pytest.raises(APIError) as info:
        parse_completion_request(completion(model="gpt-4"), MODEL)
    assert info.value.body() == {
        "error": {
            "message": "The model `gpt-4` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_completion_defaults():
    request = parse_completion_request({"prompt": "hello", "some_extra_field": {"x": 1}}, MODEL)
    assert request.model == MODEL
    assert request.prompts == ["hello"]
    assert (request.n, request.stream, request.include_usage, request.echo) == (
        1,
        False,
        False,
        False,
    )
    s = request.sampling
    assert s.max_tokens == 16
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (1.0, 1.0, -1, 0.0)
    assert (s.seed, s.stop, s.stop_token_ids, s.logprobs) == (None, [], [], None)


def test_completion_fields_reach_sampling_params():
    request = parse_completion_request(
        completion(
            prompt=[[1, 2], [3]],
            max_tokens=7,
            temperature=0,
            top_p=0.5,
            top_k=0,
            min_p=0.1,
            seed=42,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
            stop="END",
            stop_token_ids=[5, 6],
            ignore_eos=True,
            min_tokens=2,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.1,
            logprobs=2,
            user="u1",
        ),
        MODEL,
    )
    assert request.prompts == [pack_ids([1, 2]), pack_ids([3])]
    assert (request.n, request.stream, request.include_usage, request.user) == (3, True, True, "u1")
    s = request.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (7, 0.0, 0.5, -1, 0.1)
    assert (s.seed, s.stop, s.stop_token_ids, s.ignore_eos, s.min_tokens) == (
        42,
        ["END"],
        [5, 6],
        True,
        2,
    )
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert s.logprobs == 2


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [pack_ids([5, 6, 7])]),
        ([[5], [6, 7]], [pack_ids([5]), pack_ids([6, 7])]),
        ([0, 2**31 - 1], [pack_ids([0, 2**31 - 1])]),
    ],
)
def test_prompt_shapes(prompt, expected):
    assert parse_completion_request(completion(prompt=prompt), MODEL).prompts == expected


def test_chat_max_tokens_defaults_to_fill_context_and_completion_tokens_win():
    assert parse_chat_request(chat(), MODEL).sampling.max_tokens == FILL_CONTEXT
    assert parse_chat_request(chat(max_tokens=5), MODEL).sampling.max_tokens == 5
    both = parse_chat_request(chat(max_tokens=5, max_completion_tokens=9), MODEL)
    assert both.sampling.max_tokens == 9


def test_chat_messages_are_normalized():
    request = parse_chat_request(
        chat(
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                    "name": None,
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
                },
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
            ],
            chat_template_kwargs={"enable_thinking": False},
            add_generation_prompt=False,
            logprobs=True,
            top_logprobs=3,
        ),
        MODEL,
    )
    assert request.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "one\ntwo"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f"}}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    assert request.chat_template_kwargs == {"enable_thinking": False}
    assert request.add_generation_prompt is False
    assert request.sampling.logprobs == 3


def test_model_is_optional_and_null_means_absent():
    request = parse_chat_request({"messages": CHAT, "model": None, "temperature": None}, MODEL)
    assert request.model == MODEL
    assert request.sampling.temperature == 1.0


def test_logit_bias_travels_as_sorted_ids_and_values():
    body = completion(logit_bias={"17": 2, "3": -100, "200": 0.5})
    sampling = parse_completion_request(body, MODEL).sampling
    assert sampling.logit_bias_ids == [3, 17, 200]
    assert sampling.logit_bias_values == [-100.0, 2.0, 0.5]
    assert parse_completion_request(completion(), MODEL).sampling.logit_bias_ids == []


@pytest.mark.parametrize(
    "logit_bias",
    [{"-1": 1}, {"1.5": 1}, {" 2": 1}, {"2": "up"}, {"2": True}, {"2": -100.5},
     {"2": float("nan")}, {"2": 1, "02": 1}, {str(2**31): 1}, "x", [1]],
)  # fmt: skip
def test_bad_logit_bias_is_400(logit_bias):
    with pytest.raises(APIError) as refused:
        parse_completion_request(completion(logit_bias=logit_bias), MODEL)
    assert refused.value.status == 400 and refused.value.param == "logit_bias"


USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": USER, "tools": [{"type": "code", "function": {"name": "f"}}]}, "tools"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f",
          "parameters": []}}]}, "tools"),
        ({"messages": USER, "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice"),
        ({"messages": USER, "tools": "f"}, "tools"),
        ({"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": USER, "function_call": "auto"}, "function_call"),
        ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
         "response_format"),
        ({"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function",
          "function": {"name": "g"}}}, "tool_choice"),
        ({"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
        ({"messages": USER, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ],
)  # fmt: skip
def test_chat_fields_that_cannot_be_honoured_are_refused(body, param):
    with pytest.raises(APIError) as refused:
        parse_chat_request(body, MODEL)
    assert refused.value.status == 400 and refused.value.param == param


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [TOOL], "tool_choice": "none"},
        {"tools": [], "tool_choice": "auto"},
        {"tool_choice": "auto"},
        {"response_format": {"type": "text"}},
        {"modalities": ["text"]},
        {"store": True, "metadata": {"a": "b"}, "parallel_tool_calls": False},
    ],
)
def test_chat_fields_at_their_off_values_are_accepted(extra):
    assert parse_chat_request({"messages": USER, **extra}, MODEL).tools is None


@pytest.mark.parametrize("tool_choice", [None, "auto"])
def test_tools_reach_the_request_unless_tool_choice_is_none(tool_choice):
    body = {"messages": USER, "tools": [TOOL], "tool_choice": tool_choice}
    assert parse_chat_request(body, MODEL).tools == [TOOL]


@pytest.mark.parametrize(
    ("extra", "ok"),
    [
        ({"suffix": "end"}, False),
        ({"suffix": ""}, True),
        ({"best_of": 3, "n": 2}, False),
        ({"best_of": 1, "n": 2}, False),
        ({"best_of": 2, "n": 2}, True),
        ({"best_of": 1}, True),
    ],
)
def test_completion_suffix_and_best_of(extra, ok):
    body = completion(**extra)
    if ok:
        parse_completion_request(body, MODEL)
        return
    with pytest.raises(APIError) as refused:
        parse_completion_request(body, MODEL)
    assert refused.value.status == 400 and refused.value.param in extra


def test_ignored_fields_are_named_in_the_log_once(caplog):
    body = {"messages": USER, "x_test_field": 1, "store": True, "temperature": 0.5}
    with caplog.at_level("WARNING", logger="frontend_proc.unsupported"):
        parse_chat_request(body, MODEL)
        parse_chat_request(body, MODEL)
        parse_completion_request({"prompt": "x", "x_test_other": 2, "echo": False}, MODEL)
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2
    assert "'x_test_field'" in named[0] and "'x_test_other'" in named[1]


def test_continue_final_message_needs_add_generation_prompt_off():
    prefilled = USER + [{"role": "assistant", "content": "Sure:"}]
    body = {"messages": prefilled, "continue_final_message": True}
    with pytest.raises(APIError) as refused:
        parse_chat_request(body, MODEL)
    assert refused.value.param == "continue_final_message"
    request = parse_chat_request({**body, "add_generation_prompt": False}, MODEL)
    assert request.continue_final_message and not request.add_generation_prompt
