"""tool_choice "required" and a named function: the constraint each puts on the answer, and
how the constrained answer becomes calls, whole or streamed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_proc.errors import APIError
from frontend_proc.forced_tool_calls import forced_calls
from frontend_proc.schemas import parse_chat_request

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def test_a_named_function_constrains_the_answer_to_its_parameters() -> None:
    forced = forced_calls(TOOLS, NAMED)
    assert forced is not None and forced.name == "get_weather"
    assert forced.constraint.kind == "json"
    assert json.loads(forced.constraint.spec) == WEATHER["function"]["parameters"]
    # A function without parameters takes any object.
    assert json.loads(forced_calls(TOOLS, {**NAMED, "function": {"name": "get_time"}}).constraint.spec) == {"type": "object"}  # fmt: skip


def test_required_constrains_the_answer_to_an_array_of_calls_of_the_tools() -> None:
    forced = forced_calls(TOOLS, "required")
    assert forced is not None and forced.name is None
    schema = json.loads(forced.constraint.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1
    options = schema["items"]["anyOf"]
    assert [o["properties"]["name"]["enum"] for o in options] == [["get_weather"], ["get_time"]]
    assert options[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]


def test_without_parallel_calls_required_writes_exactly_one() -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    assert "maxItems" not in json.loads(parse_chat_request(body, "m").sampling.structured.spec)
    request = parse_chat_request({**body, "parallel_tool_calls": False}, "m")
    schema = json.loads(request.sampling.structured.spec)
    assert schema["minItems"] == schema["maxItems"] == 1 and request.max_tool_calls == 1
    auto = parse_chat_request({**body, "tool_choice": "auto", "parallel_tool_calls": False}, "m")
    assert auto.max_tool_calls == 1 and auto.sampling.structured is None
    with pytest.raises(APIError) as refused:
        parse_chat_request({**body, "parallel_tool_calls": "no"}, "m")
    assert refused.value.param == "parallel_tool_calls"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_auto_and_none_constrain_nothing(tool_choice) -> None:
    assert forced_calls(TOOLS, tool_choice) is None


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"tool_choice": "required"}, "needs 'tools'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "structured output"),
        ({"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "xml"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_tool_choices_are_400s(body, words) -> None:
    with pytest.raises(APIError) as caught:
        parse_chat_request({"messages": USER, **body}, "m")
    assert caught.value.status == 400 and words in caught.value.message


def test_the_request_carries_the_constraint_and_the_tools() -> None:
    request = parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": NAMED}, "m")
    assert request.tools == TOOLS and request.forced_calls is not None
    assert request.sampling.structured == request.forced_calls.constraint


def test_a_named_answer_is_its_call() -> None:
    forced = forced_calls(TOOLS, NAMED)
    content, calls = forced.split(' \n{"city": "Paris"}\n ')
    assert content is None
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert forced.finish_reason("stop", calls) == "stop"
    assert forced.finish_reason("length", calls) == "length"


def test_a_required_answer_is_its_calls() -> None:
    forced = forced_calls(TOOLS, "required")
    text = '[{"name": "get_weather", "parameters": {"city": "Pa]ris\\"}"}}, {"name": "get_time", "parameters": {}}]'
    content, calls = forced.split(text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa]ris"}'}
    assert calls[1]["function"]["arguments"] == "{}"
    assert forced.finish_reason("stop", calls) == "tool_calls"
    # Cut short before a call closed: the text is the content, and nothing is called.
    assert forced.split('[{"name": "get_we') == ('[{"name": "get_we', [])
    assert forced.finish_reason("length", []) == "length"


def merge_stream(deltas: list[dict]) -> list[dict]:
    """The calls a client assembles from the streamed deltas."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"function": {"name": "", "arguments": ""}})
        if "id" in delta:
            call["id"], call["type"] = delta["id"], delta["type"]
        function = delta.get("function", {})
        call["function"]["name"] += function.get("name", "")
        call["function"]["arguments"] += function.get("arguments", "")
    return [calls[i] for i in sorted(calls)]


def pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_any_split_of_a_stream_gives_the_whole_answers_calls(cuts) -> None:
    for tool_choice, text in (
        (NAMED, '\n  {"city": "Paris }\\" ]"}  \n'),
        ("required", '[ {"name": "get_time", "parameters": {}},\n{"name": "get_weather", "parameters": {"city": "[{\\\\"}} ]'),
    ):  # fmt: skip
        forced = forced_calls(TOOLS, tool_choice)
        _, whole = forced.split(text)
        parser = forced.parser()
        deltas, content = [], ""
        for piece in pieces(text, cuts):
            more, new = parser.feed(piece)
            content += more
            deltas += new
        more, new = parser.flush()
        content += more
        deltas += new
        assert content == ""
        streamed = merge_stream(deltas)
        assert [c["function"] for c in streamed] == [c["function"] for c in whole]
        assert parser.calls == [{k: c[k] for k in ("id", "type", "function")} for c in streamed]
