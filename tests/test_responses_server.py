"""POST /v1/responses through the real process tree (the tiny random Qwen3), through the
openai package's own client: the same answers as /v1/chat/completions, whole and streamed."""

from __future__ import annotations

import json

import pytest

from tests import eos_server

pytestmark = pytest.mark.slow

client = eos_server.client
eos_model = eos_server.eos_model
model = eos_server.model
server = eos_server.server

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}


def test_a_response_says_what_the_chat_endpoint_says(client, model):
    kwargs = dict(model=model, temperature=0, max_output_tokens=6)
    response = client.responses.create(input="Name a colour.", instructions="Be brief.", **kwargs)
    chat = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=6,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
        ],
    )
    message = chat.choices[0].message
    assert response.output_text == (message.content or "")
    reasoning = [item.content[0].text for item in response.output if item.type == "reasoning"]
    assert reasoning == ([message.reasoning_content] if message.reasoning_content else [])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert response.status == expected
    with client.responses.stream(
        input="Name a colour.", instructions="Be brief.", **kwargs
    ) as stream:
        events = list(stream)
    final = events[-1].response
    assert final.output_text == response.output_text and final.status == response.status
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == response.output_text


def test_a_named_tool_choice_comes_back_as_a_function_call_item(client, model):
    response = client.responses.create(
        model=model,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=120,
        temperature=0,
        # Qwen3 without thinking: its template closes the think block, so the calls are
        # constrained from the first token.
        reasoning={"effort": "none"},
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and calls, response.output
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # The calls and their outputs go back as input, and render as the chat endpoint renders
    # the same conversation.
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        *[
            {
                "type": "function_call",
                "call_id": c.call_id,
                "name": c.name,
                "arguments": c.arguments,
            }
            for c in calls
        ],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls],
    ]
    again = client.responses.create(
        model=model, input=follow_up, tools=[WEATHER], max_output_tokens=2
    )
    chat = client.chat.completions.create(
        model=model,
        max_tokens=2,
        tools=[CHAT_WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": c.call_id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ],
            },
            *[{"role": "tool", "tool_call_id": c.call_id, "content": "sunny"} for c in calls],
        ],
    )
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_the_messages_logprobs_match_the_chat_endpoints(client, model):
    kwargs = dict(model=model, temperature=0, max_output_tokens=5, reasoning={"effort": "none"})
    response = client.responses.create(
        input="Name a colour.", include=["message.output_text.logprobs"], top_logprobs=2, **kwargs
    )
    (message,) = response.output
    logprobs = message.content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens == 5
    assert "".join(lp.token for lp in logprobs) == response.output_text
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    chat = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        messages=[{"role": "user", "content": "Name a colour."}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    expected = [(lp.token, lp.logprob) for lp in chat.choices[0].logprobs.content]
    assert [(lp.token, lp.logprob) for lp in logprobs] == expected
