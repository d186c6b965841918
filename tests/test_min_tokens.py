"""min_tokens through the runner and the real scheduler: until a request has its minimum,
its stop tokens are never drawn, so it gives the tokens of HF ``generate`` with
``min_new_tokens``, with one step in flight or two."""

from __future__ import annotations

import json
import os

import pytest
import torch
from worker_helpers import drive, engine_config, greedy_reference, make_tiny_checkpoint

from pegainfer.protocol import SamplingParams
from worker_proc.model_runner import ModelRunner

pytest.importorskip("transformers")

PROMPT = [5, 9, 2, 77, 31, 8]
EOS_INDEX = 3  # greedy decoding reaches the EOS at this output index


@pytest.fixture(scope="module")
def eos_checkpoint(tmp_path_factory) -> tuple[str, int]:
    """A tiny Qwen3 whose EOS is a token its greedy output reaches early."""
    path = make_tiny_checkpoint(str(tmp_path_factory.mktemp("min-tokens")), "qwen3", seed=3)
    runner = ModelRunner(engine_config(path))
    free = greedy_reference(runner, PROMPT, 12)
    index = next(i for i in range(EOS_INDEX, len(free)) if free[i] not in free[:i])
    eos = free[index]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos, "pad_token_id": 0}, f)
    return path, eos


def hf_generate(path: str, eos: int, max_tokens: int, min_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=max_tokens,
            min_new_tokens=min_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_min_tokens_gives_hf_generates_tokens(eos_checkpoint, in_flight):
    path, eos = eos_checkpoint
    runner = ModelRunner(engine_config(path))
    requests = [
        ("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=12)),
        ("min", PROMPT, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8)),
        (
            "ignore",
            PROMPT,
            SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8, ignore_eos=True),
        ),
    ]
    tokens, finish, _ = drive(runner, requests, in_flight=in_flight)
    free = tokens["free"]
    assert free[-1] == eos and finish["free"] == "stop"
    expected = hf_generate(path, eos, 12, 8)
    assert tokens["min"] == expected
    assert eos not in tokens["min"][:7] and len(tokens["min"]) >= 8
    assert tokens["min"][: len(free) - 1] == free[:-1]
    # ignore_eos: EOS is an ordinary token, drawn where the model puts it.
    assert tokens["ignore"][: len(free)] == free and len(tokens["ignore"]) == 10
