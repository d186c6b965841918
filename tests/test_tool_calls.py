"""Tool calls in the Hermes format (Qwen2.5, Qwen3): the template shows the tools, the
<tool_call> blocks of the output become OpenAI tool_calls, whole or streamed, and the HTTP
layer answers in OpenAI's shapes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_chat_template import QWEN_DIR, needs_qwen
from test_tokenizer_proc import preprocessor, request  # noqa: F401 - a fixture

from frontend_proc.chat_template import ChatTemplate
from frontend_proc.preprocess import Preprocessor, handle
from frontend_proc.tool_calls import (
    ToolCallParser,
    check_tool_call_parser,
    finish_reason,
    split_tool_calls,
)
from pegainfer.cli import build_parser, config_from_args
from pegainfer.protocol import RequestRejected
from tests.fake_engine import MODEL, FakeEngine, delta, run_with_client
from tools.soak_mix import WEATHER_TOOL

CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_ROME = (
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
)
OUTPUT = f"Let me look.\n{CALL_PARIS}\n{CALL_ROME}"


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def assemble(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas put together as a client does: by index, the arguments
    concatenated."""
    calls: dict[int, dict] = {}
    for entry in deltas:
        call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
        if "id" in entry:
            assert "id" not in call, "a call announced twice"
            call.update(id=entry["id"], type=entry["type"])
            call["function"]["name"] = entry["function"]["name"]
        call["function"]["arguments"] += entry["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [calls[index] for index in sorted(calls)]


def test_a_whole_output_splits_into_content_and_calls():
    content, calls = split_tool_calls(OUTPUT)
    assert content == "Let me look."
    assert names_and_arguments(calls) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert split_tool_calls("no calls here\n") == ("no calls here\n", [])


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',  # cut off, whole
        "a < b and <tool_ca",
    ],
)
def test_what_is_not_a_call_stays_content(text):
    assert split_tool_calls(text) == (text, [])


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64])
def test_streamed_deltas_give_the_whole_outputs_result(size):
    parser = ToolCallParser()
    content, deltas = "", []
    announced_at = arguments_done_at = None
    for start in range(0, len(OUTPUT), size):
        text, new = parser.feed(OUTPUT[start : start + size])
        assert "<" not in text
        content += text
        deltas += new
        if announced_at is None and any("id" in d for d in new):
            announced_at = start + size
        pieces = "".join(d["function"].get("arguments", "") for d in deltas if d["index"] == 0)
        if arguments_done_at is None and pieces == '{"city": "Paris"}':
            arguments_done_at = start + size
    text, last = parser.flush()
    content += text
    deltas += last
    assert content.strip() == "Let me look."
    calls = assemble(deltas)
    assert names_and_arguments(calls) == names_and_arguments(split_tool_calls(OUTPUT)[1])
    assert [c["id"] for c in calls] == [c["id"] for c in parser.calls]
    # The first call is announced once its name is written, and its arguments are complete
    # before its block closes; the second (arguments as a string) comes whole at its close.
    first_close = OUTPUT.index("</tool_call>")
    assert announced_at is not None and announced_at <= OUTPUT.index('"arguments"') + size + 14
    assert arguments_done_at is not None and arguments_done_at <= first_close + size
    assert [d for d in deltas if d["index"] == 1][0]["function"]["arguments"].startswith("{")


def test_a_cut_off_call_that_was_announced_keeps_what_was_written():
    parser = ToolCallParser()
    text, deltas = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    more, last = parser.flush()
    assert text + more == ""
    (call,) = assemble(deltas + last)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    assert parser.calls[0]["id"] == call["id"]


@pytest.mark.parametrize("size", [1, 3, 7, 64, 1000])
def test_without_parallel_calls_only_the_first_comes_back(size):
    content, calls = split_tool_calls(OUTPUT, max_calls=1)
    assert content == "Let me look."
    assert names_and_arguments(calls) == [("get_weather", {"city": "Paris"})]
    parser = ToolCallParser(max_calls=1)
    streamed, deltas = "", []
    text = OUTPUT + "\n" + CALL_PARIS[:-8]  # a third, cut off: dropped too
    for start in range(0, len(text), size):
        more, new = parser.feed(text[start : start + size])
        streamed += more
        deltas += new
    more, last = parser.flush()
    assert (streamed + more).strip() == "Let me look."
    assert names_and_arguments(assemble(deltas + last)) == [("get_weather", {"city": "Paris"})]
    assert len(parser.calls) == 1


def test_the_finish_is_tool_calls_only_after_a_stop():
    assert finish_reason("stop", [{"id": "x"}]) == "tool_calls"
    assert finish_reason("length", [{"id": "x"}]) == "length"
    assert finish_reason("stop", []) == "stop"


@needs_qwen
def test_the_qwen3_template_shows_the_tools(tmp_path):
    from tokenizers import Tokenizer

    template = ChatTemplate.load(QWEN_DIR)
    tokenizer = Tokenizer.from_file(f"{QWEN_DIR}/tokenizer.json")
    qwen = Preprocessor(tokenizer, template, 4096, 151936)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    text = qwen.render_chat(messages, True, {}, [WEATHER_TOOL])
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_call>" in text
    assert "<tools>" not in qwen.render_chat(messages, True, {})


def test_a_template_without_the_call_format_refuses_tools(preprocessor):  # noqa: F811
    outcome = handle(
        preprocessor,
        request(messages=[{"role": "user", "content": "hello"}], tools=[WEATHER_TOOL]),
    )
    assert isinstance(outcome, RequestRejected)
    assert (outcome.status, outcome.param) == (400, "tools")


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], **extra}


def tool_script(request):
    pieces = [
        "Let me look.\n<tool",
        '_call>\n{"name": "get_weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ]
    return [delta(request.request_id, text) for text in pieces[:-1]] + [
        delta(request.request_id, pieces[-1], "stop", completion_tokens=20)
    ]


def test_the_http_answer_has_tool_calls_whole_and_streamed():
    engine = FakeEngine(tool_script)
    bodies = {}

    async def body(client):
        request_body = chat_body(tools=[WEATHER_TOOL], max_tokens=30)
        response = await client.post("/v1/chat/completions", json=request_body)
        bodies["whole"] = await response.json()
        response = await client.post("/v1/chat/completions", json={**request_body, "stream": True})
        bodies["stream"] = await response.text()
        plain = await client.post("/v1/chat/completions", json=chat_body(max_tokens=30))
        bodies["plain"] = await plain.json()

    run_with_client(engine, body)
    assert engine.requests[0].tools == [WEATHER_TOOL]
    choice = bodies["whole"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    assert names_and_arguments(choice["message"]["tool_calls"]) == [
        ("get_weather", {"city": "Paris"})
    ]
    chunks = [
        json.loads(line[len("data: ") :])
        for line in bodies["stream"].splitlines()
        if line.startswith("data: {")
    ]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content.strip() == "Let me look." and "<tool" not in content
    streamed = assemble([call for d in deltas for call in d.get("tool_calls", [])])
    assert names_and_arguments(streamed) == [("get_weather", {"city": "Paris"})]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Without tools the same output is plain content.
    plain = bodies["plain"]["choices"][0]
    assert "<tool_call>" in plain["message"]["content"] and plain["finish_reason"] == "stop"
    assert "tool_calls" not in plain["message"]


def two_calls_script(request):
    pieces = [
        "Let me look.\n",
        CALL_PARIS[:30],
        CALL_PARIS[30:] + "\n" + CALL_ROME[:20],
        CALL_ROME[20:],
    ]
    return [delta(request.request_id, text) for text in pieces[:-1]] + [
        delta(request.request_id, pieces[-1], "stop", completion_tokens=40)
    ]


def test_without_parallel_tool_calls_the_http_answer_has_the_first_call():
    engine = FakeEngine(two_calls_script)
    bodies = {}

    async def body(client):
        for parallel in (True, False):
            request_body = chat_body(tools=[WEATHER_TOOL], parallel_tool_calls=parallel)
            response = await client.post("/v1/chat/completions", json=request_body)
            bodies[parallel] = await response.json()
            response = await client.post(
                "/v1/chat/completions", json={**request_body, "stream": True}
            )
            bodies[parallel, "stream"] = await response.text()

    run_with_client(engine, body)
    for parallel, cities in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        expected = [("get_weather", {"city": city}) for city in cities]
        choice = bodies[parallel]["choices"][0]
        assert (
            choice["finish_reason"] == "tool_calls"
            and choice["message"]["content"] == "Let me look."
        )
        assert names_and_arguments(choice["message"]["tool_calls"]) == expected
        lines = bodies[parallel, "stream"].splitlines()
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in lines
            if line.startswith("data: {")
        ]
        streamed = assemble([call for d in deltas for call in d.get("tool_calls", [])])
        assert names_and_arguments(streamed) == expected


@needs_qwen
def test_a_whole_tool_round_renders_with_qwen3s_template():
    """An agent's second turn: the assistant's call (arguments as the JSON string OpenAI
    clients send back) and the tool's answer reach the prompt in Qwen3's format."""
    from tokenizers import Tokenizer

    from frontend_proc.messages import parse_messages

    qwen = Preprocessor(
        Tokenizer.from_file(f"{QWEN_DIR}/tokenizer.json"), ChatTemplate.load(QWEN_DIR), 4096, 151936
    )
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = parse_messages(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ]
    )
    text = qwen.render_chat(messages, True, {}, [WEATHER_TOOL])
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


ARGUMENTS = [
    {"city": "Paris"},
    {"code": "if (x) { return y; }", "n": [1, {"deep": "}}"}]},
    {},
    {"text": "a </tool_call lookalike and <tool_call> inside a string"},
]


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.sampled_from(ARGUMENTS), min_size=1, max_size=3),
    before=st.sampled_from(["", "Sure.\n", "x < y > z\n"]),
    compact=st.booleans(),
    cuts=st.lists(st.integers(1, 400), max_size=12),
)
def test_any_split_of_well_formed_calls_streams_their_arguments(calls, before, compact, cuts):
    separators = (",", ":") if compact else (", ", ": ")
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": f"f{i}", "arguments": a}, separators=separators)
        + "\n</tool_call>"
        for i, a in enumerate(calls)
    ]
    output = before + "\n".join(blocks)
    points = sorted({min(c, len(output)) for c in cuts} | {len(output)})
    parser = ToolCallParser()
    content, deltas, start = "", [], 0
    for point in points:
        text, new = parser.feed(output[start:point])
        content, deltas, start = content + text, deltas + new, point
    text, last = parser.flush()
    streamed = assemble(deltas + last)
    whole_content, whole = split_tool_calls(output)
    assert (content + text).strip() == whole_content == before.strip()
    assert names_and_arguments(streamed) == names_and_arguments(whole)
    assert names_and_arguments(whole) == [(f"f{i}", a) for i, a in enumerate(calls)]


def test_a_named_tool_call_parser_needs_a_template_that_teaches_the_format(tmp_path):
    check_tool_call_parser("auto", None)
    teaching = "{% if tools %}<tool_call>{% endif %}{{ messages[0].content }}"
    for name in ("hermes", "qwen25"):
        check_tool_call_parser(name, teaching)
        with pytest.raises(ValueError, match="writes no <tool_call> blocks"):
            check_tool_call_parser(name, "{{ messages[0].content }}")
        with pytest.raises(ValueError, match="writes no <tool_call> blocks"):
            check_tool_call_parser(name, None)
    args = build_parser().parse_args(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    assert config_from_args(args).tool_call_parser == "hermes"
    with pytest.raises(SystemExit):  # argparse: not a format this server parses
        build_parser().parse_args(["--tool-call-parser", "mistral"])


@needs_qwen
def test_qwen3s_template_satisfies_the_hermes_parser():
    check_tool_call_parser("hermes", ChatTemplate.load(QWEN_DIR).source)
