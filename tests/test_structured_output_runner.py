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
    ]  # fmt: skip


def serve(runner: ModelRunner, in_flight: int) -> tuple[dict, dict, int]:
    deferred = 0
    submit = runner.submit

    def counting_submit(plan: StepPlan) -> None:
        nonlocal deferred
        deferred += plan.masks_follow
        submit(plan)

    runner.submit = counting_submit
    try:
        outputs, finish, _ = drive(
            runner, requests(), in_flight, max_model_len=256, num_kv_blocks=400
        )
    finally:
        runner.submit = submit
    return outputs, finish, deferred


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
    one, finish_one, deferred_one = serve(runner, 1)
    two, finish_two, deferred_two = serve(runner, 2)
    assert deferred_one == 0 and deferred_two > 5
    assert two == one and finish_two == finish_one
    for name in ("json", "sampled"):
        assert finish_one[name] == "stop"
        document = json.loads(tokenizer.decode(one[name][:-1]))
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
