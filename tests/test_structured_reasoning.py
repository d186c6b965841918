"""Structured output after reasoning: a chat answer of a model that thinks first (Qwen3) is
constrained from the token after its ``</think>``, the reasoning left free. Covers the
tokenizer process's choice, the scheduler's sleeping grammars and gated masks, and the
worker's gate, without the process tree."""

from __future__ import annotations

import json

import numpy as np
import pytest

from frontend_proc.chat_template import ChatTemplate
from frontend_proc.preprocess import Preprocessor
from frontend_proc.reasoning import check_reasoning_parser, turn_reasoning
from pegainfer.cli import build_parser, config_from_args
from pegainfer.protocol import (
    GenerateRequest,
    SamplingParams,
    StepResult,
    StructuredOutput,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.scheduler import Scheduler
from tests.test_structured_output import SCHEMA, allowed_ids, qwen3_config, request, settle

__all__ = ["qwen3_config"]  # a fixture, shared

THINK_START, THINK_END = 151667, 151668
IM_START, IM_END = 151644, 151645
JSON = StructuredOutput("json", json.dumps(SCHEMA))


# -- the tokenizer process: which prompts leave the model to reason first ------------------


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ([IM_START, 77091, 198], "none"),  # "<|im_start|>assistant\n": Qwen3 opens its own
        ([IM_START, 77091, 198, THINK_START, 198], "open"),  # the template opened it
        ([IM_START, 77091, 198, THINK_START, 271, THINK_END, 271], "closed"),
        # A think block of an earlier turn does not close this one's.
        ([THINK_START, 5, THINK_END, 6, IM_END, IM_START, 77091, 198], "none"),
        ([], "none"),
    ],
)
def test_where_the_turn_stands_with_its_reasoning(tail, expected) -> None:
    assert turn_reasoning([1, 2] + tail, THINK_START, THINK_END, {IM_START, IM_END}) == expected


@pytest.fixture(scope="module")
def preprocessor(tiny_qwen3_dir) -> Preprocessor:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")
    return Preprocessor(tokenizer, ChatTemplate.load(tiny_qwen3_dir), 4096, 151936)


def chat(structured, thinking: bool | None = None, messages=None) -> GenerateRequest:
    return GenerateRequest(
        request_id="r",
        prompt=None,
        prompt_token_ids=None,
        messages=messages or [{"role": "user", "content": "Is it? Answer in JSON."}],
        chat_template_kwargs={} if thinking is None else {"enable_thinking": thinking},
        add_generation_prompt=True,
        sampling=SamplingParams(max_tokens=100, structured=structured),
        arrival_time=0.0,
    )


def test_a_thinking_chat_answer_is_constrained_after_its_reasoning(preprocessor) -> None:
    assert preprocessor.process(chat(JSON)).sampling.structured.after_token_id == THINK_END
    assert (
        preprocessor.process(chat(JSON, thinking=True)).sampling.structured.after_token_id
        == THINK_END
    )
    # The template closes the think block in the prompt: the answer comes at once.
    assert preprocessor.process(chat(JSON, thinking=False)).sampling.structured.after_token_id == -1
    # The unconstrained keep their sampling as it was.
    assert preprocessor.process(chat(None)).sampling.structured is None
    # A completion's prompt is the client's own: constrained from its first token.
    completion = chat(JSON)
    completion.messages, completion.prompt = None, "<think>\n"
    assert preprocessor.process(completion).sampling.structured.after_token_id == -1


def test_a_model_that_does_not_reason_is_constrained_from_the_start(preprocessor) -> None:
    # The same tokenizer (it has the think tokens), a template that never writes them.
    template = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    plain = Preprocessor(preprocessor.tokenizer, template, 4096, 151936)
    assert not plain.reasons_in_think_blocks()
    sampling = plain.process(chat(JSON)).sampling
    assert sampling.structured.after_token_id == -1 and not sampling.starts_in_reasoning


def test_the_reasoning_parser_option_overrides_the_detection(preprocessor, tiny_qwen3_dir):
    tokenizer, template = preprocessor.tokenizer, preprocessor.chat_template
    assert preprocessor.reasoning
    off = Preprocessor(tokenizer, template, 4096, 151936, reasoning_parser="none")
    assert not off.reasoning
    sampling = off.process(chat(JSON)).sampling
    assert sampling.structured.after_token_id == -1 and not sampling.starts_in_reasoning
    # Named, it splits at </think> even under a template that never writes the tags.
    plain = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
    for name in ("qwen3", "deepseek_r1"):
        named = Preprocessor(tokenizer, plain, 4096, 151936, reasoning_parser=name)
        assert named.reasoning
        assert named.process(chat(JSON)).sampling.structured.after_token_id == THINK_END
    check_reasoning_parser(tiny_qwen3_dir, "qwen3")


def test_a_named_reasoning_parser_needs_the_think_tokens(tmp_path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    for name in ("auto", "none"):
        check_reasoning_parser(str(tmp_path), name)
    with pytest.raises(ValueError, match="no <think> or </think> token"):
        check_reasoning_parser(str(tmp_path), "deepseek_r1")
    with pytest.raises(SystemExit):  # argparse: not a choice
        build_parser().parse_args(["--reasoning-parser", "granite"])
    args = build_parser().parse_args(["--reasoning-parser", "none"])
    assert config_from_args(args).reasoning_parser == "none"


def test_a_prompt_that_opens_the_think_block_starts_the_output_in_it(preprocessor) -> None:
    # As the templates of Qwen3's thinking-only models end every prompt: "<think>\n".
    messages = [
        {"role": "user", "content": "Is it?"},
        {"role": "assistant", "content": "<think>\nLet me see"},
    ]
    request = chat(JSON, messages=messages)
    request.add_generation_prompt, request.continue_final_message = False, True
    sampling = preprocessor.process(request).sampling
    assert sampling.starts_in_reasoning and sampling.structured.after_token_id == THINK_END
    assert not preprocessor.process(chat(None)).sampling.starts_in_reasoning
    assert not preprocessor.process(chat(None, thinking=False)).sampling.starts_in_reasoning


# -- the scheduler: a sleeping grammar, and masks gated on the token that wakes it --------


def bits_allowed(words: bytes, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(np.frombuffer(words, dtype="<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def draw(view, samplers: list[int], state: dict, vocab_size, rng) -> StepResult:
    """A worker: a masked row draws among its mask's tokens; a gated row among its first
    mask's if its token before is the gate (</think>), else freely. While a row's script
    lasts (its reasoning) it may draw any token, and writes the script; after it, the row
    must be constrained; rows without a grammar draw token 100."""
    masked = unpack_ids(view.masked_seq_ids)
    gated = unpack_ids(view.gated_seq_ids)
    previous, scripts, first_masks = state["previous"], state["scripts"], state["first_masks"]
    tokens = []
    for seq_id in samplers:
        allowed = None
        if seq_id in masked:
            allowed = allowed_ids(view, seq_id, vocab_size)
        elif seq_id in gated and previous.get(seq_id) == THINK_END:
            allowed = bits_allowed(first_masks[seq_id], vocab_size)
        script = scripts.get(seq_id)
        if script:
            assert allowed is None, "a mask on a row still reasoning"
            tokens.append(script.pop(0))
        elif script is not None or allowed is not None:
            assert allowed is not None, "no mask on a row past its </think>"
            tokens.append(int(rng.choice(allowed)))
        else:
            tokens.append(100)
        previous[seq_id] = tokens[-1]
    return StepResult(step_id=view.step_id, seq_ids=pack_ids(samplers), token_ids=pack_ids(tokens))


def run_with_reasoning(
    scheduler: Scheduler, reasoning: dict[str, list[int]], vocab_size: int, seed: int = 0
):
    """Every request to its end with two plans in flight, as the process runs them; a
    request named in ``reasoning`` writes those tokens first (ending with ``</think>``)."""
    rng = np.random.default_rng(seed)
    outputs: dict[str, list[int]] = {}
    finishes: dict[str, str] = {}
    state: dict = {"previous": {}, "scripts": {}, "first_masks": {}}
    in_flight, masks_of, counts = [], {}, {"gated": 0, "follow": 0}
    for _ in range(2000):
        settle(scheduler)
        while len(in_flight) < 2 and not scheduler.constrained.deferred:
            plan = scheduler.schedule()
            if plan is None:
                break
            for new in plan.new_seqs:
                request_id = scheduler._seq_to_request[new.seq_id].request_id
                if request_id in reasoning:
                    state["scripts"].setdefault(new.seq_id, list(reasoning[request_id]))
                    assert new.first_mask, "a sleeping grammar's sequence brings its first mask"
                    state["first_masks"][new.seq_id] = new.first_mask
            in_flight.append(plan)
            counts["gated"] += bool(plan.gated_seq_ids)
            counts["follow"] += plan.masks_follow
            if not plan.masks_follow:
                masks_of[plan.step_id] = (plan.masked_seq_ids, plan.token_bitmask)
        if not in_flight:
            break
        plan = in_flight.pop(0)
        masked_seq_ids, bitmask = masks_of.pop(plan.step_id)
        fields = {"step_id": plan.step_id, "masked_seq_ids": masked_seq_ids, "token_bitmask": bitmask, "gated_seq_ids": plan.gated_seq_ids}  # fmt: skip
        view = type("Plan", (), fields)
        samplers = list(scheduler._in_flight[plan.step_id])
        result = draw(view, samplers, state, vocab_size, rng)
        for output in scheduler.on_step_result(result):
            outputs.setdefault(output.request_id, []).extend(unpack_ids(output.new_token_ids))
            if output.finish_reason is not None:
                finishes[output.request_id] = output.finish_reason
        for masks in scheduler.take_step_masks():
            masks_of[masks.step_id] = (masks.masked_seq_ids, masks.token_bitmask)
    assert not scheduler.has_work() and not in_flight
    return outputs, finishes, counts


def thinking(structured: StructuredOutput) -> StructuredOutput:
    return StructuredOutput(structured.kind, structured.spec, after_token_id=THINK_END)


@pytest.mark.parametrize("num_thoughts", [0, 1, 2, 5, 30])
def test_the_answer_after_the_reasoning_keeps_to_its_grammar(qwen3_config, num_thoughts) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{qwen3_config.model_path}/tokenizer.json")
    scheduler = Scheduler(qwen3_config)
    # Free tokens a grammar would refuse ("}" and "<|im_end|>"-free text), then </think>.
    thoughts = (
        [THINK_START] + [16, 92] * (num_thoughts // 2) + [16] * (num_thoughts % 2) + [THINK_END]
    )
    scheduler.add_request(request("think", thinking(JSON), max_tokens=300))
    scheduler.add_request(request("plain", JSON, max_tokens=300))
    scheduler.add_request(request("free", None, max_tokens=40))
    outputs, finishes, counts = run_with_reasoning(
        scheduler, {"think": thoughts}, qwen3_config.model.vocab_size
    )
    assert outputs["think"][: len(thoughts)] == thoughts
    for name in ("think", "plain"):
        assert finishes[name] == "stop"
        answer = outputs[name][len(thoughts) if name == "think" else 0 : -1]
        document = json.loads(tokenizer.decode(answer))
        assert document["answer"] in ("yes", "no")
    assert outputs["free"] == [100] * 40
    # With "plain" answering in the same steps, most masks follow their plans.
    assert counts["follow"] >= 10
    assert scheduler.constrained.num_live == 0


def test_reasoning_alone_never_waits_for_masks(qwen3_config) -> None:
    scheduler = Scheduler(qwen3_config)
    thoughts = [THINK_START] + [16] * 20 + [THINK_END]
    for i in range(3):
        scheduler.add_request(request(f"t{i}", thinking(StructuredOutput("choice", '["yes", "no"]')), max_tokens=60))  # fmt: skip
    outputs, finishes, counts = run_with_reasoning(
        scheduler, {f"t{i}": thoughts for i in range(3)}, qwen3_config.model.vocab_size
    )
    # Each step while they reason carries their gated first masks; only the answers'
    # steps after the first wait for masks.
    assert counts["gated"] >= 20
    for i in range(3):
        assert finishes[f"t{i}"] == "stop"
        assert outputs[f"t{i}"][: len(thoughts)] == thoughts
    assert counts["follow"] <= 3 * 4
