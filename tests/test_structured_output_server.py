"""Structured output through the real process tree, on the tiny random Qwen3: whatever the
model's weights, the answer follows the constraint, and a greedy answer is HF's greedy
answer under the same grammar's masks."""

from __future__ import annotations

import json
import re
import threading

import openai
import pytest
from tokenizers import Tokenizer

from tests.server_util import Server

pytestmark = pytest.mark.slow
pytest.importorskip("xgrammar")

PROMPT = "Reply in JSON:"
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
# Qwen3 thinks first unless told not to, and a chat answer is constrained after its
# reasoning: the random model would not close its think block.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINK_END = 151668


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "pegainfer.log"
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", "512", "--max-num-batched-tokens", "64",
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir) -> Tokenizer:
    return Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")


def complete(server, **body) -> dict:
    status, out = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 200, **body})
    assert status == 200, out
    return out["choices"][0]


def complete_together(server, bodies: dict[str, dict]) -> dict[str, dict]:
    """Each body's completion, all sent at once (one thread each)."""
    results: dict[str, dict] = {}

    def run(name: str) -> None:
        results[name] = complete(server, **bodies[name])

    threads = [threading.Thread(target=run, args=(name,)) for name in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def hf_constrained_greedy(model_dir: str, prompt_ids: list[int], structured, count: int):
    """HF's greedy tokens with every step's logits masked by the grammar, as the server
    compiles it."""
    import torch
    import xgrammar
    from transformers import AutoModelForCausalLM

    from pegainfer.config import read_model_info
    from scheduler_proc.grammar import GrammarCompiler, RequestGrammar

    info = read_model_info(model_dir)
    compiler = GrammarCompiler(model_dir, info.vocab_size, list(info.eos_token_ids))
    grammar = RequestGrammar(compiler.compile(structured))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    ids = list(prompt_ids)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(count):
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
            grammar.fill(bitmask, 0)
            xgrammar.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask)
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in info.eos_token_ids:
                break
            assert grammar.accept(token)
    return out


def test_greedy_json_schema_answer_is_hfs_under_the_same_masks(server, tiny_qwen3_dir, tokenizer):
    from pegainfer.protocol import StructuredOutput

    choice = complete(
        server, temperature=0, response_format=JSON_SCHEMA_FORMAT, return_token_ids=True
    )
    assert choice["finish_reason"] == "stop", choice
    document = json.loads(choice["text"])
    assert document["answer"] in ("yes", "no") and 0 <= document["count"] <= 99
    expected = hf_constrained_greedy(
        tiny_qwen3_dir,
        tokenizer.encode(PROMPT).ids,
        StructuredOutput("json", json.dumps(SCHEMA)),
        200,
    )
    assert choice["token_ids"] == expected


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_answers_follow_the_schema(server, seed):
    for body in (
        {"response_format": JSON_SCHEMA_FORMAT},
        {"structured_outputs": {"json": SCHEMA}},
        {"guided_json": json.dumps(SCHEMA)},
    ):
        choice = complete(server, temperature=1.0, seed=seed, **body)
        assert choice["finish_reason"] == "stop", choice
        document = json.loads(choice["text"])
        assert set(document) == {"answer", "count"} and document["answer"] in ("yes", "no")


def test_choice_regex_and_grammar(server):
    choices = ["red", "green", "dark blue"]
    for seed in range(4):
        choice = complete(
            server, temperature=1.0, seed=seed, structured_outputs={"choice": choices}
        )
        assert choice["text"] in choices and choice["finish_reason"] == "stop"
        choice = complete(server, temperature=1.0, seed=seed, guided_regex=r"\d{3}-[a-z]{2,4}")
        assert re.fullmatch(r"\d{3}-[a-z]{2,4}", choice["text"]), choice
        choice = complete(
            server,
            temperature=1.0,
            seed=seed,
            structured_outputs={"grammar": 'root ::= "<" [xyz]+ ">"'},
        )
        assert re.fullmatch(r"<[xyz]+>", choice["text"]), choice


def test_a_lark_grammar(server):
    lark = 'start: "<" item ("," item)* ">"\nitem: "x".."z" ~ 1..2 | INT\n%import common.INT'
    for seed in range(3):
        choice = complete(server, temperature=1.0, seed=seed, structured_outputs={"grammar": lark})
        assert re.fullmatch(r"<([x-z]{1,2}|\d+)(,([x-z]{1,2}|\d+))*>", choice["text"]), choice
    status, out = server.post(
        "/v1/completions",
        {"prompt": PROMPT, "structured_outputs": {"grammar": 'start: "a"\n%ignore WS'}},
    )
    assert status == 400 and "line 2: %ignore" in out["error"]["message"], out


def test_structural_tags_in_both_formats(server):
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tag = {
        "type": "tag",
        "begin": "<call>",
        "content": {"type": "json_schema", "json_schema": city},
        "end": "</call>",
    }
    choice = complete(
        server, max_tokens=40, response_format={"type": "structural_tag", "format": tag}
    )
    assert choice["text"].startswith("<call>"), choice
    # The older format, as vLLM's example sends it: free text until the trigger.
    legacy = {
        "type": "structural_tag",
        "triggers": ["<function="],
        "structures": [{"begin": "<function=get_weather>", "schema": city, "end": "</function>"}],
    }
    choice = complete(server, max_tokens=40, temperature=1.0, seed=3, response_format=legacy)
    text = choice["text"]
    if "<function=" in text:  # the random model wrote the trigger: only the tag may follow
        rest = text.split("<function=", 1)[1]
        assert rest.startswith("get_weather>") or "get_weather>".startswith(rest), text
    status, out = server.post(
        "/v1/completions", {"prompt": PROMPT, "response_format": {**legacy, "triggers": ["<x"]}}
    )
    assert status == 400 and "does not match any trigger" in out["error"]["message"], out


def test_chat_json_object_streams_what_it_answers(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
    body = dict(
        model="tiny-qwen30",
        messages=[{"role": "user", "content": "a JSON object, please"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        extra_body=NO_THINKING,
    )
    body["model"] = client.models.list().data[0].id
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "stop"
    assert json.loads(whole.message.content)["answer"] in ("yes", "no")
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **body)
        if chunk.choices
    )
    assert streamed == whole.message.content
    json_object = client.chat.completions.create(
        **{**body, "response_format": {"type": "json_object"}, "max_tokens": 8}
    ).choices[0]
    assert json_object.message.content.startswith("{")


def test_a_thinking_answer_is_constrained_after_its_reasoning(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
    # The prompt opens the think block (as Qwen3's thinking-only templates do), and the
    # bias makes </think> the first token: free while reasoning, then the grammar holds.
    body = dict(
        model=client.models.list().data[0].id,
        messages=[
            {"role": "user", "content": "a JSON object, please"},
            {"role": "assistant", "content": "<think>\nLet me see"},
        ],
        max_tokens=80,
        temperature=0,
        logit_bias={str(THINK_END): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}},
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "stop"
    assert whole.message.reasoning_content == ""
    assert json.loads(whole.message.content)["answer"] in ("yes", "no")
    chunks = list(client.chat.completions.create(stream=True, **body))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.message.content
    # Without the bias the random model never closes its think block: all reasoning, free.
    del body["logit_bias"]
    free = client.chat.completions.create(**{**body, "max_tokens": 12}).choices[0]
    assert free.finish_reason == "length" and free.message.content == ""
    assert free.message.reasoning_content


def test_unconstrained_requests_beside_constrained_ones_are_unchanged(server):
    alone = [complete(server, temperature=0, max_tokens=24, prompt=f"Story {i}:") for i in range(3)]
    bodies = {
        f"free{i}": dict(temperature=0, max_tokens=24, prompt=f"Story {i}:") for i in range(3)
    }
    for i in range(3):
        bodies[f"json{i}"] = dict(temperature=1.0, seed=i, response_format=JSON_SCHEMA_FORMAT)
    results = complete_together(server, bodies)
    for i in range(3):
        assert results[f"free{i}"]["text"] == alone[i]["text"]
        assert json.loads(results[f"json{i}"]["text"])["answer"] in ("yes", "no")


def test_bad_constraints_are_400s_and_the_server_goes_on(server):
    for body, words in (
        ({"guided_regex": "[0-9"}, "Unclosed"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}}, "bogus"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "grammar"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ):  # fmt: skip
        status, out = server.post("/v1/completions", {"prompt": PROMPT, **body})
        assert status == 400, out
        assert words in out["error"]["message"]
    assert complete(server, structured_outputs={"choice": ["ok"]})["text"] == "ok"
    status, metrics = server.get("/health")
    assert status == 200


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def chat(server, stream: bool = False, **body):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)
    fields = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=120,
        tools=TOOLS,
        temperature=0,
        extra_body=NO_THINKING,
    )
    return client.chat.completions.create(stream=stream, **{**fields, **body})


def test_a_named_tool_choice_answers_with_that_call(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(server, tool_choice=named).choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    # Streamed: the call first, then its arguments, which add up to the same.
    chunks = list(chat(server, stream=True, tool_choice=named))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_named_tool_call_follows_the_reasoning(server):
    named = {"type": "function", "function": {"name": "get_weather"}}
    thinking = dict(
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "<think>\nThe user wants"},
        ],
        logit_bias={str(THINK_END): 100},
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    choice = chat(server, tool_choice=named, **thinking).choices[0]
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == ""
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(chat(server, stream=True, tool_choice=named, **thinking))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def check_calls(calls) -> None:
    for call in calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert arguments["city"] in ("Paris", "Rome")
        else:
            assert call.function.name == "get_time" and arguments == {}


def test_required_tool_choice_answers_with_calls(server):
    # The random model may go on adding calls: an answer cut short keeps those it closed.
    finishes = []
    for seed in (None, 1, 2, 3):
        sampling = dict(temperature=0) if seed is None else dict(temperature=1.0, seed=seed)
        choice = chat(server, tool_choice="required", max_tokens=300, **sampling).choices[0]
        finishes.append(choice.finish_reason)
        assert choice.finish_reason in ("tool_calls", "length"), choice
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls and choice.message.content is None
        check_calls(choice.message.tool_calls)
        chunks = list(chat(server, stream=True, tool_choice="required", max_tokens=300, **sampling))
        streamed = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in streamed] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == finishes[-1]
    assert "tool_calls" in finishes, finishes


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_constrained_answers_follow_their_constraints(tiny_qwen3_dir, tmp_path):
    """bf16 on the GPU, decode graphs and two steps in flight for the unconstrained."""
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--device", "cuda", "--max-model-len", "512",
        "--gpu-memory-utilization", "0.3", log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip
    try:
        regex = r"\d{3}-[a-z]{2,4}"
        bodies: dict[str, dict] = {}
        for i in range(4):
            bodies[f"json{i}"] = dict(temperature=1.0, seed=i, response_format=JSON_SCHEMA_FORMAT)
            bodies[f"free{i}"] = dict(temperature=0, max_tokens=32, prompt=f"Story {i}:")
            bodies[f"greedy{i}"] = dict(temperature=0, guided_regex=regex, prompt=f"Code {i}:")
        results = complete_together(srv, bodies)
        for i in range(4):
            document = json.loads(results[f"json{i}"]["text"])
            assert document["answer"] in ("yes", "no") and 0 <= document["count"] <= 99
            assert re.fullmatch(r"\d{3}-[a-z]{2,4}", results[f"greedy{i}"]["text"])
            alone = complete(
                srv, temperature=0, guided_regex=r"\d{3}-[a-z]{2,4}", prompt=f"Code {i}:"
            )
            assert alone["text"] == results[f"greedy{i}"]["text"]
            free = complete(srv, temperature=0, max_tokens=32, prompt=f"Story {i}:")
            assert free["text"] == results[f"free{i}"]["text"]
        choice = chat(
            srv, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        ).choices[0]
        (call,) = choice.message.tool_calls
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
