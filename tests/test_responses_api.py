"""POST /v1/responses: its body read as a chat request, and its answers, whole and streamed,
against a fake engine (checked with the openai package's own models); the served tree's
answers are in tests/test_responses_server.py."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from frontend_proc.app import create_app
from frontend_proc.errors import APIError
from frontend_proc.responses_request import parse_responses_request
from frontend_proc.serving_common import ServingContext
from pegainfer.protocol import TokenLogprobs, pack_floats, pack_ids
from tests.fake_engine import BOOM, MODEL, FakeEngine, config, delta

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def parse(**body):
    return parse_responses_request(body, MODEL)


# -- the body, read as a chat request -----------------------------------------------------


def test_input_items_become_the_conversation():
    request = parse(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "A tool."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "And"}, {"type": "input_text", "text": "Rome?"}]},
        ],
        tools=[WEATHER],
        max_output_tokens=7,
        temperature=0.5,
    )  # fmt: skip
    chat = request.chat
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "A tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And\nRome?"},
    ]
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]  # fmt: skip
    assert (chat.sampling.max_tokens, chat.sampling.temperature, chat.n) == (7, 0.5, 1)
    assert request.echo["tools"] == [WEATHER] and request.echo["instructions"] == "Be brief."


def test_formats_tool_choices_and_reasoning_effort_map_to_their_chat_forms():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "a", "schema": schema}}
    assert parse(input="x", text=fmt).chat.sampling.structured.kind == "json"
    assert parse(input="x", text={"format": {"type": "json_object"}}).chat.sampling.structured.kind == "json_object"  # fmt: skip
    assert parse(input="x", text={"format": {"type": "text"}}).chat.sampling.structured is None
    named = parse(
        input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}
    )
    assert named.chat.forced_calls is not None and named.chat.forced_calls.name == "get_weather"
    assert parse(input="x", tools=[WEATHER], tool_choice="required").chat.forced_calls is not None
    assert parse(input="x", reasoning={"effort": "none"}).chat.chat_template_kwargs == {"enable_thinking": False}  # fmt: skip
    assert parse(input="x", reasoning={"effort": "high"}).chat.chat_template_kwargs == {}
    assert parse(input="x", tools=[WEATHER], max_tool_calls=1).chat.max_tool_calls == 1


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "not stored"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "not stored"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
        ({"input": "x", "top_logprobs": 21}, "top_logprobs", "at most 20"),
        ({"input": "x", "include": "all"}, "include", "a list"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input",
            "'input_image'",
        ),  # fmt: skip
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "'item_reference'"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"role": "system", "content": "only"}]}, "input", "no message"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text", "'grammar'"),
        ({"input": "x", "max_output_tokens": 0}, "max_completion_tokens", "at least 1"),
        ({"input": "x", "temperature": "hot"}, "temperature", "number"),
    ],
)
def test_what_cannot_be_served_is_a_400_naming_it(body, param, message):
    with pytest.raises(APIError) as caught:
        parse_responses_request(body, MODEL)
    assert caught.value.status == 400 and caught.value.param == param
    assert message in caught.value.message


# -- answers from a fake engine ------------------------------------------------------------


def serve(script_text: list[str], finish: str = "stop", reasoning: bool = True) -> FakeEngine:
    def script(request):
        deltas = [
            delta(request.request_id, text, None, 9, i + 1) for i, text in enumerate(script_text)
        ]
        deltas[-1].finish_reason = finish
        for item in deltas:
            item.token_ids = b"\0\0\0\0"  # one token each
        return deltas

    engine = FakeEngine(script)
    engine.reasoning = reasoning
    return engine


def post(engine: FakeEngine, body: dict) -> tuple[int, str]:
    async def main() -> tuple[int, str]:
        app = create_app(config(), engine, reasoning=engine.reasoning)
        async with TestClient(TestServer(app)) as client:
            resp = await client.post("/v1/responses", json=body)
            return resp.status, await resp.text()

    return asyncio.run(main())


def events_of(raw: str) -> list[dict]:
    events = []
    for block in raw.split("\n\n")[:-1]:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        EVENTS.validate_python(event)
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def test_a_whole_answer_with_reasoning_and_a_message():
    status, raw = post(
        serve(["<think>", "Let me", " see.</think>", "\n\nParis", "."]), {"input": "Capital?"}
    )
    assert status == 200, raw
    response = Response.model_validate_json(raw)
    assert response.status == "completed" and response.id.startswith("resp_")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Let me see."
    assert message.type == "message" and response.output_text == "\n\nParis."
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.output_tokens_details.reasoning_tokens) == (9, 5, 3)  # fmt: skip


def test_a_streamed_answer_announces_each_item_and_ends_with_the_whole_response():
    texts = ["<think>", "Hm", "</think>", "Call", " it:", CALL]
    body = {"input": "Weather?", "tools": [WEATHER], "stream": True}
    status, raw = post(serve(texts), body)
    assert status == 200, raw
    events = events_of(raw)
    kinds = [event["type"] for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and "[DONE]" not in raw
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    call = final.output[2]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    # Each item is announced and closed once, by the id the final response gives it.
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Call it:" == final.output[1].content[0].text
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")  # fmt: skip
    assert json.loads(arguments) == {"city": "Paris"}


def test_an_answer_cut_by_max_output_tokens_is_incomplete():
    status, raw = post(serve(["Par", "is"], finish="length", reasoning=False), {"input": "x"})
    response = Response.model_validate_json(raw)
    assert (
        response.status == "incomplete"
        and response.incomplete_details.reason == "max_output_tokens"
    )
    assert response.output[0].status == "incomplete"
    status, raw = post(serve(["Par"], finish="length"), {"input": "x", "stream": True})
    assert events_of(raw)[-1]["type"] == "response.incomplete"


def test_a_stored_response_is_never_found():
    async def main() -> None:
        async with TestClient(TestServer(create_app(config(), FakeEngine()))) as client:
            resp = await client.get("/v1/responses/resp_123")
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"

    asyncio.run(main())


def test_cache_writes_are_the_full_blocks_a_prompt_computed():
    ctx = ServingContext("m", "/m", 64, FakeEngine(), cache_block_size=16)
    assert [ctx.cache_write_tokens(p, c) for p, c in ((9, 0), (40, 0), (40, 16), (48, 48))] == [0, 32, 16, 0]  # fmt: skip
    ctx.cache_block_size = 0  # no prefix cache
    assert ctx.cache_write_tokens(40, 0) == 0


def test_a_stream_that_fails_ends_with_an_error_event():
    def script(request):
        return [delta(request.request_id, "Par", None, 9, 1), BOOM]

    engine = FakeEngine(script)
    engine.reasoning = False
    status, raw = post(engine, {"input": "x", "stream": True})
    events = events_of(raw)
    assert status == 200 and events[-1]["type"] == "error"
    assert events[-1]["message"] == "internal error: RuntimeError"
    assert [e["type"] for e in events][:-1] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert engine.active == set()


def with_logprobs(script_text: list[str], reasoning: bool = True) -> FakeEngine:
    """Each scripted token with its logprob (-0.5) and itself as the one alternative."""
    engine = serve(script_text, reasoning=reasoning)
    plain = engine.script

    def script(request):
        deltas = plain(request)
        for index, item in enumerate(deltas):
            data = item.text.encode()
            item.logprobs = TokenLogprobs(
                start=index,
                token_ids=pack_ids([index]),
                logprobs=pack_floats([-0.5]),
                num_top=1,
                top_ids=pack_ids([index]),
                top_logprobs=pack_floats([-0.5]),
                token_bytes=[data, data],
            )
        return deltas

    engine.script = script
    return engine


LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}


def test_the_messages_tokens_logprobs_leave_out_reasoning_and_calls():
    texts = ["<think>", "Hm", "</think>", "\n\nCall", " it:", CALL]
    body = {"input": "x", "tools": [WEATHER], **LOGPROBS}
    status, raw = post(with_logprobs(texts), body)
    response = Response.model_validate_json(raw)
    assert response.top_logprobs == 1
    part = response.output[1].content[0]
    assert [lp.token for lp in part.logprobs] == ["\n\nCall", " it:"]
    assert part.logprobs[0].logprob == -0.5 and len(part.logprobs[0].top_logprobs) == 1
    # Streamed: the same tokens, each with the delta it wrote.
    status, raw = post(with_logprobs(texts), {**body, "stream": True})
    events = events_of(raw)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in e["logprobs"]] for e in deltas] == [["\n\nCall"], [" it:"]]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert [lp["token"] for lp in done["logprobs"]] == ["\n\nCall", " it:"]
    final = Response.model_validate(events[-1]["response"])
    assert final.output[1].content[0].logprobs == part.logprobs
    # Not asked: none.
    status, raw = post(with_logprobs(texts), {"input": "x", "tools": [WEATHER]})
    assert Response.model_validate_json(raw).output[1].content[0].logprobs == []


def test_a_model_that_does_not_reason_has_every_token_in_its_message():
    status, raw = post(with_logprobs(["Par", "is"], reasoning=False), {"input": "x", **LOGPROBS})
    part = Response.model_validate_json(raw).output[0].content[0]
    assert [lp.token for lp in part.logprobs] == ["Par", "is"]
