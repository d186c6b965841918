"""vLLM's ``bad_words``: the token sequences the tokenizer process makes of them, the bans
the scheduler plans (gated on the token in flight), the worker's edits, and a real model
that never writes a banned sequence, with one or two steps in flight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from worker_helpers import drive, engine_config

from frontend_proc.engine_extras import bad_words_token_ids, get_bad_words
from frontend_proc.errors import APIError
from pegainfer.protocol import SamplingParams, StepPlan, unpack_ids
from scheduler_proc.bad_words import BadWordBans
from worker_proc.logit_edits import bias_edits, gated_bans
from worker_proc.model_runner import ModelRunner
from worker_proc.upload import Uploader

CPU = torch.device("cpu")


def test_each_word_is_banned_at_the_start_and_after_a_space() -> None:
    vocab = {"cat": [5], " cat": [6], "black cat": [7, 6], " black cat": [8, 6]}
    sequences = bad_words_token_ids(["cat", " black cat", "cat"], lambda text: vocab[text])
    assert sequences == [[5], [6], [7, 6], [8, 6]]
    assert get_bad_words({"bad_words": ["a", "a", "b"]}) == ["a", "b"]
    for bad in (["  "], "word", [3]):
        with pytest.raises(APIError, match="bad_words"):
            get_bad_words({"bad_words": bad})


def request(seq_id: int, words: list[list[int]], output: list[int], pending: int):
    return SimpleNamespace(
        request_id=f"r{seq_id}",
        seq_id=seq_id,
        output_token_ids=output,
        num_pending_tokens=pending,
        sampling=SamplingParams(bad_words_token_ids=words),
    )


def bans_of(plan: StepPlan) -> list[tuple[int, int, int]]:
    fields = (plan.ban_seq_ids, plan.ban_token_ids, plan.ban_gates)
    return list(zip(*(unpack_ids(field) for field in fields)))


def test_a_longer_word_bans_its_last_token_where_the_output_ends_with_the_rest() -> None:
    words = [[1, 2], [3, 4, 5], [9]]  # the one-token word is the worker's own
    bans = BadWordBans()
    requests = [
        request(10, words, [7, 1], pending=1),  # [1] known: ban 2 outright
        request(11, words, [3, 4], pending=1),  # [3, 4] known: ban 5
        request(12, words, [7, 3], pending=2),  # one in flight: ban 2 if it is 1, 5 if it is 4
        request(13, words, [], pending=2),  # the first token in flight: only [1, 2] can end
        request(14, words, [3, 4], pending=1),  # not sampling this step
    ]
    for r in requests:
        bans.add(r)
    assert bans.num_live == 5
    plan = StepPlan(0, [], b"", b"", b"", [], b"")
    bans.mark(plan, requests, samplers=[10, 11, 12, 13])
    assert bans_of(plan) == [(10, 2, -1), (11, 5, -1), (12, 2, 1), (12, 5, 4), (13, 2, 1)]
    bans.drop("r10")
    bans.drop("r10")
    assert bans.num_live == 4
    only_short = request(20, [[9], [8]], [1], pending=1)
    bans.add(only_short)
    assert bans.num_live == 4  # one-token words need no planning


def test_the_worker_bans_one_token_words_always_and_gated_ones_on_their_gate() -> None:
    uploader = Uploader(CPU)
    params = [
        SamplingParams(logit_bias_ids=[3], logit_bias_values=[2.0], bad_words_token_ids=[[4], [5, 6]]),
        SamplingParams(),
        SamplingParams(bad_words_token_ids=[[3]]),
    ]  # fmt: skip
    logits = torch.zeros(3, 10)
    bias_edits(params, uploader).apply(logits)
    assert logits[0, 3] == 2.0 and logits[0, 4] == -torch.inf and logits[2, 3] == -torch.inf
    assert torch.isfinite(logits[1]).all() and torch.isfinite(logits[0, 5:]).all()
    rows = [SimpleNamespace(seq_id=s) for s in (40, 41, 42)]
    bans = gated_bans([40, 41, 42, 42], [6, 7, 8, 9], [5, 5, -1, 2], rows, uploader)
    last_tokens = torch.tensor([0, 5, 4, 2])  # per slot; the rows sit in slots 1, 2, 3
    bans.open_gates(last_tokens, torch.tensor([1, 2, 3]))
    logits = torch.zeros(3, 10)
    bans.apply(logits)
    banned = {(r, t) for r, t in zip(*torch.nonzero(logits == -torch.inf, as_tuple=True))}
    assert {(int(r), int(t)) for r, t in banned} == {(0, 6), (2, 8), (2, 9)}
    with pytest.raises(ValueError, match="samples no token"):
        gated_bans([99], [1], [-1], rows, uploader)


PROMPT = [9707, 11, 1879, 0, 374]


def serve(runner, in_flight: int, words: list[list[int]], temperature: float = 0.0) -> list[int]:
    sampling = SamplingParams(
        temperature=temperature, seed=3, max_tokens=40, ignore_eos=True, bad_words_token_ids=words
    )
    outputs, _, _ = drive(runner, [("r", PROMPT, sampling), ("free", PROMPT[:3], SamplingParams(temperature=0.0, max_tokens=30))], in_flight)  # fmt: skip
    return outputs["r"]


def serve_counting_gates(runner, words: list[list[int]], temperature: float):
    """``serve`` with two steps in flight, and every ban gate its plans carried."""
    gates: list[int] = []
    submit = runner.submit

    def counting_submit(plan: StepPlan) -> None:
        gates.extend(unpack_ids(plan.ban_gates))
        submit(plan)

    runner.submit = counting_submit
    try:
        return serve(runner, 2, words, temperature), gates
    finally:
        runner.submit = submit


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
def test_a_model_never_writes_a_banned_sequence(tiny_qwen3_dir, device) -> None:
    dtype = "float32" if device == "cpu" else "bfloat16"
    runner = ModelRunner(
        engine_config(tiny_qwen3_dir, dtype=dtype, device=device, max_model_len=128)
    )
    for temperature in (0.0, 1.0):
        free = serve(runner, 1, [], temperature)
        # Words the model writes unbanned: a pair and a triple from its output, and a token.
        words = [free[4:6], free[10:13], [free[20]]]
        one = serve(runner, 1, words, temperature)
        two, gates = serve_counting_gates(runner, words, temperature)
        assert one == two
        assert any(gate >= 0 for gate in gates)  # bans waited for the token in flight
        assert one != free and one[:4] == free[:4]
        for word in words:
            assert not contains(one, word), (word, one)
