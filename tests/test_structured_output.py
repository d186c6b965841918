"""Structured output without the process tree: the request fields, and the scheduler's
grammars and masks (with the real tokenizer of the tiny Qwen3). The worker's edit of the
logits is in test_token_masks.py."""

from __future__ import annotations

import json
import re
import time

import numpy as np
import pytest

from frontend_proc.errors import APIError
from frontend_proc.structured_output import parse_structured_output
from pegainfer.config import read_model_info
from pegainfer.protocol import (
    RequestRejected,
    SamplingParams,
    StepResult,
    StructuredOutput,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.grammar import choice_grammar
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import make_config

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}


# -- the request fields ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            StructuredOutput("json", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput("choice", '["x", "y"]')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput("grammar", 'root ::= "a"')),
        ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
        ({"guided_choice": ["a"]}, StructuredOutput("choice", '["a"]')),
        ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_grammar": 'root ::= "b"'}, StructuredOutput("grammar", 'root ::= "b"')),
        # vLLM's options: compact JSON; two that change nothing here.
        ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
         StructuredOutput("json_object", compact_json=True)),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True, "disable_fallback": True,
                                 "disable_additional_properties": False}}, StructuredOutput("regex", "a+")),
    ],
)  # fmt: skip
def test_each_way_of_asking_gives_its_constraint(body, expected) -> None:
    assert parse_structured_output(body) == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs"),
        ({"guided_json": "[" * 100_000 + "]" * 100_000}, "guided_json"),
        ({"guided_json": '{"enum": ["\\ud800"]}'}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"guided_choice": ["a", 3]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ],
)  # fmt: skip
def test_malformed_constraints_are_a_400_naming_the_field(body, param) -> None:
    with pytest.raises(APIError) as caught:
        parse_structured_output(body)
    assert caught.value.status == 400
    assert caught.value.param == param


def test_a_choice_grammar_quotes_its_strings() -> None:
    assert choice_grammar(['a "b"', "c\\d\n"]) == 'root ::= "a \\"b\\"" | "c\\\\d\\n"'


# -- the scheduler --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_config(tiny_qwen3_dir):
    model = read_model_info(tiny_qwen3_dir)
    return make_config(
        model_path=tiny_qwen3_dir,
        model=model,
        max_model_len=256,
        max_num_batched_tokens=64,
        num_kv_blocks=256,
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")


def request(request_id: str, structured: StructuredOutput | None, **sampling) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=request_id,
        prompt_token_ids=pack_ids([9707, 11, 1879]),
        sampling=SamplingParams(max_tokens=sampling.pop("max_tokens", 40), structured=structured, **sampling),
        arrival_time=time.time(),
    )  # fmt: skip


def settle(scheduler: Scheduler, timeout: float = 60.0) -> list[RequestRejected]:
    """Wait for the compiles in progress; the rejections they made."""
    deadline = time.monotonic() + timeout
    rejections = []
    while scheduler.num_compiling:
        assert time.monotonic() < deadline, "a grammar took too long to compile"
        rejections += scheduler.collect_grammars()
        time.sleep(0.005)
    return rejections


def allowed_ids(plan, seq_id: int, vocab_size: int) -> np.ndarray:
    seq_ids = unpack_ids(plan.masked_seq_ids)
    words = np.frombuffer(plan.token_bitmask, dtype="<i4").reshape(len(seq_ids), -1)
    bits = np.unpackbits(words[seq_ids.index(seq_id)].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def answer(plan, samplers: list[int], vocab_size: int, rng: np.random.Generator) -> StepResult:
    """A worker that draws each constrained row's token at random among the allowed ones,
    and gives the others token 100."""
    masked = set(unpack_ids(plan.masked_seq_ids))
    tokens = [
        int(rng.choice(allowed_ids(plan, seq_id, vocab_size))) if seq_id in masked else 100
        for seq_id in samplers
    ]
    return StepResult(step_id=plan.step_id, seq_ids=pack_ids(samplers), token_ids=pack_ids(tokens))


def run_to_end(scheduler: Scheduler, vocab_size: int, seed: int = 0, max_steps: int = 500):
    """Plan and answer one step at a time until idle; every request's tokens and finish."""
    rng = np.random.default_rng(seed)
    outputs: dict[str, list[int]] = {}
    finishes: dict[str, str] = {}
    for _ in range(max_steps):
        settle(scheduler)
        plan = scheduler.schedule()
        if plan is None:
            break
        result = answer(plan, list(scheduler._in_flight[plan.step_id]), vocab_size, rng)
        for output in scheduler.on_step_result(result):
            outputs.setdefault(output.request_id, []).extend(unpack_ids(output.new_token_ids))
            if output.finish_reason is not None:
                finishes[output.request_id] = output.finish_reason
    assert not scheduler.has_work()
    return outputs, finishes


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        (StructuredOutput("choice", '["alpha", "beta", "gamma delta"]'),
         lambda text: text in ("alpha", "beta", "gamma delta")),
        (StructuredOutput("regex", "[0-9]{3}-[a-z]{2}"),
         lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text) is not None),
        (StructuredOutput("grammar", 'root ::= "(" [a-c]* ")"'),
         lambda text: re.fullmatch(r"\([a-c]*\)", text) is not None),
    ],
)  # fmt: skip
def test_a_constrained_request_writes_only_what_its_grammar_allows(
    qwen3_config, tokenizer, structured, check
) -> None:
    scheduler = Scheduler(qwen3_config)
    eos = set(qwen3_config.model.eos_token_ids)
    assert scheduler.add_request(request("c", structured, max_tokens=200)) is None
    assert scheduler.add_request(request("free", None, max_tokens=5)) is None
    assert scheduler.num_compiling == 1 and scheduler.has_work()
    for seed in range(3):
        if seed:
            assert scheduler.add_request(request("c", structured, max_tokens=200)) is None
        outputs, finishes = run_to_end(scheduler, qwen3_config.model.vocab_size, seed)
        tokens = outputs["c"]
        assert finishes["c"] == "stop" and tokens[-1] in eos, tokens
        text = tokenizer.decode(tokens[:-1], skip_special_tokens=False)
        assert check(text), text
        if seed == 0:  # the unconstrained request beside it took no mask
            assert outputs["free"] == [100] * 5 and finishes["free"] == "length"
    assert scheduler.constrained.num_live == 0


def test_a_json_schema_request_ends_with_a_valid_document(qwen3_config, tokenizer) -> None:
    scheduler = Scheduler(qwen3_config)
    structured = StructuredOutput("json", json.dumps(SCHEMA))
    for seed in range(3):
        assert scheduler.add_request(request(f"j{seed}", structured, max_tokens=250)) is None
    outputs, finishes = run_to_end(scheduler, qwen3_config.model.vocab_size, seed=7)
    for seed in range(3):
        tokens = outputs[f"j{seed}"]
        assert finishes[f"j{seed}"] == "stop", tokenizer.decode(tokens)
        document = json.loads(tokenizer.decode(tokens[:-1]))
        assert document["answer"] in ("yes", "no") and 0 <= document["count"] <= 9
        assert set(document) == {"answer", "count"}


def test_an_ended_grammar_leaves_a_request_ignoring_eos_unconstrained(
    qwen3_config, tokenizer
) -> None:
    scheduler = Scheduler(qwen3_config)
    structured = StructuredOutput("choice", '["yes"]')
    scheduler.add_request(request("c", structured, max_tokens=12, ignore_eos=True))
    outputs, finishes = run_to_end(scheduler, qwen3_config.model.vocab_size)
    tokens = outputs["c"]
    assert finishes["c"] == "length" and len(tokens) == 12
    end = next(i for i, t in enumerate(tokens) if t in qwen3_config.model.eos_token_ids)
    assert tokenizer.decode(tokens[:end]) == "yes"
    # After its stop token, no mask: the sim worker gives unmasked rows token 100.
    assert tokens[end + 1 :] == [100] * (len(tokens) - end - 1)


def test_masks_go_only_to_constrained_rows_that_sample(qwen3_config) -> None:
    config = make_config(**{**qwen3_config.__dict__, "max_num_batched_tokens": 2})
    scheduler = Scheduler(config)
    scheduler.add_request(request("c", StructuredOutput("regex", "[ab]+")))
    settle(scheduler)
    scheduler.add_request(request("free", None))
    plan = scheduler.schedule()  # a 2-token chunk of c's 3-token prompt: no sampling
    assert plan is not None and plan.masked_seq_ids == b"" and plan.token_bitmask == b""
    scheduler.on_step_result(StepResult(plan.step_id, b"", b""))
    plan = scheduler.schedule()  # c's last prompt token, which samples, and free's first
    assert plan is not None and len(unpack_ids(plan.seq_ids)) == 2
    assert unpack_ids(plan.masked_seq_ids) == unpack_ids(plan.seq_ids)[:1]
    words = (config.model.vocab_size + 31) // 32
    assert len(plan.token_bitmask) == 4 * words
    allowed = allowed_ids(plan, unpack_ids(plan.masked_seq_ids)[0], config.model.vocab_size)
    assert 0 < len(allowed) < 1000  # tokens made of a and b only


def test_with_two_steps_in_flight_the_masks_follow_the_token_they_wait_for(qwen3_config) -> None:
    scheduler = Scheduler(qwen3_config)
    scheduler.add_request(request("c", StructuredOutput("regex", "[ab]+"), max_tokens=10))
    settle(scheduler)
    scheduler.add_request(request("free", None, max_tokens=10))
    first = scheduler.schedule()
    assert first is not None and len(unpack_ids(first.seq_ids)) == 2
    assert not first.masks_follow and len(unpack_ids(first.masked_seq_ids)) == 1
    # The second plan, before the first answers: c's mask needs the token in flight.
    second = scheduler.schedule()
    assert second is not None and len(unpack_ids(second.seq_ids)) == 2
    assert second.masks_follow and second.token_bitmask == b""
    assert unpack_ids(second.masked_seq_ids) == unpack_ids(first.masked_seq_ids)
    assert scheduler.take_step_masks() == []
    # A third may not be planned past a plan whose masks are owed (nor past two of c's).
    assert scheduler.constrained.deferred
    c_seq = unpack_ids(first.masked_seq_ids)[0]
    a_token = 64  # "a"
    free_seq = next(s for s in unpack_ids(first.seq_ids) if s != c_seq)
    result = StepResult(first.step_id, pack_ids([c_seq, free_seq]), pack_ids([a_token, 100]))
    scheduler.on_step_result(result)
    (masks,) = scheduler.take_step_masks()
    assert masks.step_id == second.step_id and masks.masked_seq_ids == second.masked_seq_ids
    allowed = allowed_ids(
        type("Plan", (), {"masked_seq_ids": masks.masked_seq_ids, "token_bitmask": masks.token_bitmask}),
        c_seq,
        qwen3_config.model.vocab_size,
    )  # fmt: skip
    assert a_token in allowed and 0 < len(allowed) < 1000
    assert not scheduler.constrained.deferred and scheduler.take_step_masks() == []


def run_two_in_flight(scheduler: Scheduler, vocab_size: int, seed: int = 0, max_steps: int = 800):
    """As ``run_to_end``, but with up to two plans in flight, as the process runs them: a
    plan is answered once its masks are known, inline or by a StepMasks."""
    rng = np.random.default_rng(seed)
    outputs: dict[str, list[int]] = {}
    finishes: dict[str, str] = {}
    in_flight: list = []  # plans, oldest first
    masks_of: dict[int, tuple[bytes, bytes]] = {}
    deferred_seen = 0
    for _ in range(max_steps):
        settle(scheduler)
        while len(in_flight) < 2 and not scheduler.constrained.deferred:
            plan = scheduler.schedule()
            if plan is None:
                break
            in_flight.append(plan)
            deferred_seen += plan.masks_follow
            if not plan.masks_follow:
                masks_of[plan.step_id] = (plan.masked_seq_ids, plan.token_bitmask)
        if not in_flight:
            break
        plan = in_flight.pop(0)
        masked_seq_ids, bitmask = masks_of.pop(plan.step_id)
        view = type(
            "Plan",
            (),
            {"step_id": plan.step_id, "masked_seq_ids": masked_seq_ids, "token_bitmask": bitmask},
        )
        result = answer(view, list(scheduler._in_flight[plan.step_id]), vocab_size, rng)
        for output in scheduler.on_step_result(result):
            outputs.setdefault(output.request_id, []).extend(unpack_ids(output.new_token_ids))
            if output.finish_reason is not None:
                finishes[output.request_id] = output.finish_reason
        for masks in scheduler.take_step_masks():
            masks_of[masks.step_id] = (masks.masked_seq_ids, masks.token_bitmask)
    assert not scheduler.has_work() and not in_flight
    return outputs, finishes, deferred_seen


def test_two_steps_in_flight_keep_every_answer_in_its_grammar(qwen3_config, tokenizer) -> None:
    scheduler = Scheduler(qwen3_config)
    structured = StructuredOutput("json", json.dumps(SCHEMA))
    for i in range(4):
        scheduler.add_request(request(f"j{i}", structured, max_tokens=250))
        scheduler.add_request(request(f"free{i}", None, max_tokens=20))
    scheduler.add_request(request("yes", StructuredOutput("choice", '["yes"]'), max_tokens=8, ignore_eos=True))  # fmt: skip
    outputs, finishes, deferred = run_two_in_flight(scheduler, qwen3_config.model.vocab_size)
    assert deferred > 10
    for i in range(4):
        assert finishes[f"j{i}"] == "stop"
        document = json.loads(tokenizer.decode(outputs[f"j{i}"][:-1]))
        assert document["answer"] in ("yes", "no") and 0 <= document["count"] <= 9
        assert outputs[f"free{i}"] == [100] * 20
    tokens = outputs["yes"]
    end = next(i for i, t in enumerate(tokens) if t in qwen3_config.model.eos_token_ids)
    assert tokenizer.decode(tokens[:end]) == "yes" and len(tokens) == 8
    assert scheduler.constrained.num_live == 0


def test_rows_filled_on_threads_equal_rows_filled_one_by_one(qwen3_config) -> None:
    from scheduler_proc.grammar import BitmaskBuffer, GrammarCompiler, RequestGrammar

    model = qwen3_config.model
    compiler = GrammarCompiler(qwen3_config.model_path, model.vocab_size, model.eos_token_ids)
    specs = [
        StructuredOutput("regex", "[a-z ,.]+"),
        StructuredOutput("json", json.dumps(SCHEMA)),
        StructuredOutput("choice", '["yes", "no"]'),
    ]
    # A matcher each: one matcher filled on two threads at once would race.
    grammars = [RequestGrammar(compiler.compile(spec)) for spec in specs * 3]
    for grammar in grammars[1::3]:
        assert grammar.accept(90)  # '{'
    words = compiler.bitmask_words()
    together = BitmaskBuffer(words, max_threads=4).pack(grammars)
    one_by_one = b"".join(BitmaskBuffer(words).pack([g]) for g in grammars)
    assert together == one_by_one and len(together) == 9 * 4 * words


def test_a_constraint_that_does_not_compile_is_refused(qwen3_config) -> None:
    scheduler = Scheduler(qwen3_config)
    assert scheduler.add_request(request("bad", StructuredOutput("regex", "[a-"))) is None
    (rejection,) = settle(scheduler)
    assert rejection.request_id == "bad" and rejection.status == 400
    assert "regex" in rejection.message and "Unclosed" in rejection.message
    assert not re.match(r"\[\d", rejection.message.split(": ", 1)[1])  # no log prefix
    assert scheduler.get_request("bad") is None and not scheduler.has_work()
    assert scheduler.constrained.num_live == 0
    # The id is free again.
    assert scheduler.add_request(request("bad", StructuredOutput("regex", "a"))) is None


def test_an_abort_while_compiling_forgets_the_request(qwen3_config) -> None:
    scheduler = Scheduler(qwen3_config)
    assert scheduler.add_request(request("c", StructuredOutput("json", json.dumps(SCHEMA)))) is None
    (output,) = scheduler.abort(["c"])
    assert output.finish_reason == "abort"
    assert scheduler.num_compiling == 0 and not scheduler.has_work()
    assert scheduler.constrained.num_live == 0
    assert scheduler.schedule() is None


def test_compact_json_allows_no_whitespace_but_the_separators(qwen3_config, tokenizer) -> None:
    from scheduler_proc.grammar import BitmaskBuffer, GrammarCompiler, RequestGrammar

    model = qwen3_config.model
    compiler = GrammarCompiler(qwen3_config.model_path, model.vocab_size, model.eos_token_ids)
    buffer = BitmaskBuffer(compiler.bitmask_words())
    newline, space = tokenizer.token_to_id("\u010a"), tokenizer.token_to_id("\u0120")
    allowed = {}
    for compact in (False, True):
        grammar = RequestGrammar(
            compiler.compile(StructuredOutput("json", json.dumps(SCHEMA), compact_json=compact))
        )
        assert grammar.accept(90)  # '{'
        words = np.frombuffer(buffer.pack([grammar]), dtype="<i4")
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        allowed[compact] = {newline: bool(bits[newline]), space: bool(bits[space])}
    assert allowed[False] == {newline: True, space: True}
    assert allowed[True] == {newline: False, space: False}
