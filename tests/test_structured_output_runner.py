"""Structured output through the runner and the real scheduler: with two steps in flight a
constrained row's masks follow its plan (StepMasks) while the forward pass runs, and the
tokens are those of one step in flight."""

from __future__ import annotations

import json

import pytest
import torch
from worker_helpers import drive, engine_config

from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    SamplingParams,
    StepMasks,
    StepPlan,
    StructuredOutput,
    pack_ids,
    unpack_ids,
)
from worker_proc.live_seqs import PlanError
from worker_proc.model_runner import ModelRunner

pytest.importorskip("xgrammar")

PROMPT = [9707, 11, 1879, 0, 374]
THINK_END = 151668
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "maximum": 99}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


def requests() -> list[tuple[str, list[int], SamplingParams]]:
    json_schema = StructuredOutput("json", json.dumps(SCHEMA))
    choice = StructuredOutput("choice", '["red", "green", "dark blue"]')
    return [
        ("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        ("json", PROMPT, SamplingParams(temperature=0.0, max_tokens=120, structured=json_schema)),
        ("choice", PROMPT[:3], SamplingParams(temperature=0.0, max_tokens=20, structured=choice)),
        ("sampled", PROMPT, SamplingParams(temperature=1.0, seed=5, max_tokens=120, structured=json_schema)),
        # Constrained after its </think> (151668), which the bias draws first; its second
        # token is planned while the first is in flight: a mask gated on </think>.
        ("reasoned", PROMPT, SamplingParams(
            temperature=0.0, max_tokens=120, logit_bias_ids=[THINK_END], logit_bias_values=[100.0],
            structured=StructuredOutput("json", json.dumps(SCHEMA), after_token_id=THINK_END),
        )),
        # Never draws </think>: every gate of its steps stays shut, and it runs free.
        ("asleep", PROMPT[1:], SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias_ids=[THINK_END],
            logit_bias_values=[-100.0],
            structured=StructuredOutput("json", json.dumps(SCHEMA), after_token_id=THINK_END),
        )),
    ]  # fmt: skip


def serve(runner: ModelRunner, in_flight: int, only=None) -> tuple[dict, dict, int, int]:
    deferred = gated = 0
    submit = runner.submit

    def counting_submit(plan: StepPlan) -> None:
        nonlocal deferred, gated
        deferred += plan.masks_follow
        gated += bool(plan.gated_seq_ids)
        submit(plan)

    runner.submit = counting_submit
    try:
        outputs, finish, _ = drive(
            runner,
            [r for r in requests() if only is None or r[0] in only],
            in_flight,
            max_model_len=256,
            num_kv_blocks=400,
        )
    finally:
        runner.submit = submit
    return outputs, finish, deferred, gated


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
def test_masks_that_follow_give_the_tokens_of_one_step_in_flight(tiny_qwen3_dir, device):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")
    dtype = "float32" if device == "cpu" else "bfloat16"
    runner = ModelRunner(
        engine_config(tiny_qwen3_dir, dtype=dtype, device=device, max_model_len=256)
    )
    one, finish_one, deferred_one, gated_one = serve(runner, 1)
    two, finish_two, deferred_two, gated_two = serve(runner, 2)
    assert deferred_one == 0 and deferred_two > 5
    assert two == one and finish_two == finish_one
    # Without other constrained rows, whose masks follow, the reasoned row's are gated.
    names = ("free", "reasoned", "asleep")
    reasoned, _, _, gated = serve(runner, 2, only=names)
    assert gated >= 10 and reasoned == {k: one[k] for k in names}
    # A grammar that never wakes changes nothing: the tokens of the same request without it.
    (_, prompt, sampling) = next(r for r in requests() if r[0] == "asleep")
    sampling.structured = None
    plain, _, _ = drive(
        runner, [("asleep", prompt, sampling)], 2, max_model_len=256, num_kv_blocks=400
    )
    assert plain["asleep"] == one["asleep"] and len(plain["asleep"]) == 30
    assert one["reasoned"][0] == THINK_END
    for name in ("json", "sampled", "reasoned"):
        assert finish_one[name] == "stop"
        answer = one[name][1:-1] if name == "reasoned" else one[name][:-1]
        document = json.loads(tokenizer.decode(answer))
        assert document["answer"] in ("yes", "no") and document["n"] <= 99
    assert tokenizer.decode(one["choice"][:-1]) in ("red", "green", "dark blue")
    assert len(one["free"]) == 40


def test_a_plan_may_not_overtake_the_masks_it_waits_for(tiny_qwen3_dir):
    runner = ModelRunner(engine_config(tiny_qwen3_dir, max_model_len=256))
    sampling = SamplingParams(temperature=0.0, max_tokens=4)
    new = NewSequence(seq_id=1, token_ids=pack_ids(PROMPT), sampling=sampling, num_prompt_tokens=5)
    plan = StepPlan(
        0, [new], pack_ids([1]), pack_ids([0]), pack_ids([5]),
        [BlockTableUpdate(1, pack_ids([0, 1]))], b"",
        masked_seq_ids=pack_ids([1]), masks_follow=True,
    )  # fmt: skip
    runner.submit(plan)
    assert runner.awaits_masks and runner.has_pending() and runner.poll_results() == []
    later = StepPlan(1, [], pack_ids([1]), pack_ids([5]), pack_ids([1]), [], b"")
    with pytest.raises(PlanError, match="waits for its token masks"):
        runner.submit(later)
    with pytest.raises(PlanError, match="does not wait"):
        runner.supply_masks(StepMasks(7, pack_ids([1]), b""))
    with pytest.raises(PlanError, match="other rows"):
        runner.supply_masks(StepMasks(0, pack_ids([2]), b""))
    # Token 42 alone allowed: the draw takes it, greedy or not.
    words = torch.zeros((runner.model_config.vocab_size + 31) // 32, dtype=torch.int32)
    words[42 // 32] = 1 << (42 % 32)
    runner.supply_masks(StepMasks(0, pack_ids([1]), words.numpy().astype("<i4").tobytes()))
    assert not runner.awaits_masks
    (result,) = runner.poll_results(wait=True)
    assert result.step_id == 0 and unpack_ids(result.token_ids) == [42]
