"""Structural tags: free text until a trigger, then a tag's begin, JSON content and end; in
xgrammar's format and in the older one of ``structures`` and ``triggers``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from frontend_proc.errors import APIError
from frontend_proc.structured_output import parse_structured_output
from pegainfer.config import read_model_info
from pegainfer.protocol import StepResult, StructuredOutput, pack_ids, unpack_ids
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import make_config
from tests.test_structured_output import allowed_ids, request, settle

pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY = {
    "structures": [{"begin": "<function=get_weather>", "schema": CITY, "end": "</function>"}],
    "triggers": ["<function="],
}
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<call>",
        "content": {"type": "json_schema", "json_schema": CITY},
        "end": "</call>",
    },
}


def legacy_spec() -> str:
    return json.dumps({"type": "structural_tag", **LEGACY})


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "structural_tag", **LEGACY}},
        {"structured_outputs": {"structural_tag": json.dumps(LEGACY)}},
        {"structured_outputs": {"structural_tag": LEGACY}},
        {"structural_tag": json.dumps(LEGACY)},
    ],
)
def test_each_way_of_asking_gives_the_tag(body) -> None:
    assert parse_structured_output(body) == StructuredOutput("structural_tag", legacy_spec())


def test_xgrammar_s_format_travels_as_given() -> None:
    parsed = parse_structured_output({"response_format": TAG})
    assert parsed == StructuredOutput("structural_tag", json.dumps(TAG))


@pytest.mark.parametrize(
    "tag",
    [
        "not json",
        [1],
        {"triggers": ["<"]},  # no format, no structures
        {"structures": [], "triggers": ["<"]},
        {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<"]},
        {"structures": [{"begin": "<a>", "schema": {}, "end": 3}], "triggers": ["<"]},
        {"structures": LEGACY["structures"], "triggers": [""]},
        {"structures": LEGACY["structures"]},
    ],
)
def test_malformed_tags_are_a_400(tag) -> None:
    with pytest.raises(APIError) as caught:
        parse_structured_output({"structured_outputs": {"structural_tag": tag}})
    assert caught.value.status == 400 and caught.value.param == "structured_outputs"


# -- the scheduler, with the real compiler ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_config(tiny_qwen3_dir):
    model = read_model_info(tiny_qwen3_dir)
    return make_config(
        model_path=tiny_qwen3_dir, model=model, max_model_len=256, max_num_batched_tokens=64,
        num_kv_blocks=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")


def run_scripted(scheduler: Scheduler, vocab_size: int, script: list[int], seed: int):
    """Run to the end with a worker that writes ``script`` as long as its masks allow, then
    random allowed tokens: a model that opens a tag and leaves the rest to chance."""
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    finish = None
    following = True
    while (plan := (settle(scheduler), scheduler.schedule())[1]) is not None:
        (seq_id,) = scheduler._in_flight[plan.step_id]
        allowed = allowed_ids(plan, seq_id, vocab_size)
        following = following and len(tokens) < len(script) and script[len(tokens)] in allowed
        token = script[len(tokens)] if following else int(rng.choice(allowed))
        result = StepResult(plan.step_id, pack_ids([seq_id]), pack_ids([token]))
        for output in scheduler.on_step_result(result):
            tokens += unpack_ids(output.new_token_ids)
            finish = output.finish_reason or finish
    return tokens, finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_after_its_trigger_the_text_is_the_tag(qwen3_config, tokenizer, seed) -> None:
    scheduler = Scheduler(qwen3_config)
    opening = "Let me look. <function="
    # The script goes on to another function's name, which the tag does not allow.
    script = tokenizer.encode(opening + "get_time>{}", add_special_tokens=False).ids
    structured = StructuredOutput("structural_tag", legacy_spec())
    assert scheduler.add_request(request("t", structured, max_tokens=120)) is None
    tokens, finish = run_scripted(scheduler, qwen3_config.model.vocab_size, script, seed)
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.startswith(opening + "get_weather>"), text
    content, closed, _ = text[len(opening + "get_weather>") :].partition("</function>")
    if finish == "stop" or closed:
        assert closed, text
        assert isinstance(json.loads(content)["city"], str), text


@pytest.mark.parametrize(
    "answer", ['<call>{"city": "Rome"}</call>', 'Hello <call>{"city": "Rome"}']
)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_tag_format_holds_the_whole_answer(qwen3_config, tokenizer, answer, seed) -> None:
    scheduler = Scheduler(qwen3_config)
    structured = StructuredOutput("structural_tag", json.dumps(TAG))
    assert scheduler.add_request(request("t", structured, max_tokens=200)) is None
    script = tokenizer.encode(answer, add_special_tokens=False).ids
    tokens, finish = run_scripted(scheduler, qwen3_config.model.vocab_size, script, seed)
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    assert text.startswith("<call>"), text  # "Hello" first was not allowed
    if answer.startswith("<call>"):  # followed to its end, where only EOS may come
        assert finish == "stop" and tokenizer.decode(tokens[:-1]) == answer
        assert tokens[-1] in qwen3_config.model.eos_token_ids
    elif finish == "stop":
        body = tokenizer.decode(tokens[:-1])
        assert body.endswith("</call>"), text
        assert isinstance(json.loads(body[len("<call>") : -len("</call>")])["city"], str)


def test_a_tag_that_does_not_compile_is_refused_with_xgrammar_s_reason(qwen3_config) -> None:
    scheduler = Scheduler(qwen3_config)
    bad = {"structures": [{"begin": "<a>", "schema": CITY, "end": "</a>"}], "triggers": ["<b"]}
    structured = StructuredOutput("structural_tag", json.dumps(bad))
    assert scheduler.add_request(request("bad", structured)) is None
    (rejection,) = settle(scheduler)
    assert rejection.status == 400
    assert rejection.message.startswith("the structural_tag constraint does not compile: ")
    assert "does not match any trigger" in rejection.message
    assert "Check failed" not in rejection.message


def test_a_regex_content_is_written_out_and_keeps_its_language(qwen3_config) -> None:
    import xgrammar

    from scheduler_proc.grammar import compile_structural_tag, read_tokenizer_info

    model = qwen3_config.model
    info = read_tokenizer_info(
        xgrammar, qwen3_config.model_path, model.vocab_size, list(model.eos_token_ids)
    )
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    content = {"type": "regex", "pattern": "[a-z ]+"}
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<r>", "content": content, "end": "</r>"}}  # fmt: skip
    compiled = compile_structural_tag(compiler, tag)
    assert tag["format"]["content"]["pattern"] == "[a-z ]+"  # the request's own is unchanged
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string("<r>ab c</r>") and matcher.accept_token(model.eos_token_ids[0])
    assert not xgrammar.GrammarMatcher(compiled).accept_string("<r></r>")
