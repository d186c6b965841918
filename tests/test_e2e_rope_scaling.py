"""A context longer than pretraining, through the real process tree: `--rope-scaling` with
YaRN, as Qwen3 reaches 128k tokens, gives the greedy tokens HF transformers gives with the same
config, past the original context; and a `--max-model-len` past the positions is refused."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from tests.hf_reference import hf_greedy
from tests.server_util import Server

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

# The tiny checkpoint's positions cut to 128, stretched four times from 64 by YaRN.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
MAX_POSITIONS = 128
PROMPT_LENS = [150, 40]
NUM_TOKENS = 24


def _hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={**YARN, "rope_theta": 1_000_000.0},
    ).eval()
    return [hf_greedy(model, ids, NUM_TOKENS) for ids in prompts]


def test_yarn_tokens_match_transformers_past_the_original_context(tiny_qwen3_dir, tmp_path):
    rng = random.Random()
    prompts = [[rng.randrange(1000, 100_000) for _ in range(n)] for n in PROMPT_LENS]
    server = Server(
        "--model-path", tiny_qwen3_dir, "--dtype", "float32", "--kv-cache-memory", "64MiB",
        "--max-num-batched-tokens", "64",
        "--hf-overrides", json.dumps({"max_position_embeddings": MAX_POSITIONS}),
        "--rope-scaling", json.dumps(YARN),
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip
    try:
        status, models = server.get("/v1/models")
        assert status == 200 and models["data"][0]["max_model_len"] == 4 * 64
        ours = []
        for ids in prompts:
            status, body = server.post(
                "/v1/completions",
                {
                    "prompt": ids,
                    "max_tokens": NUM_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            assert status == 200, body
            ours.append(body["choices"][0]["token_ids"])
        # 250 tokens of prompt and output pass the 256-token context.
        status, body = server.post(
            "/v1/completions", {"prompt": prompts[0], "max_tokens": 120, "temperature": 0}
        )
        assert status == 400 and "256" in body["error"]["message"], body
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert server.leftovers() == []
    for got, want in zip(ours, _hf_greedy(tiny_qwen3_dir, prompts)):
        assert len(want) == NUM_TOKENS
        assert got == want


def _start_fails(*args: str) -> str:
    """Run `pegainfer` expecting it to stop before serving; its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "pegainfer.cli", "--port", "1", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_a_context_past_the_positions_or_an_unknown_scaling_is_refused(tiny_qwen3_dir):
    out = _start_fails("--model-path", tiny_qwen3_dir, "--max-model-len", "100000")
    assert "--max-model-len 100000 is longer than the 4096 positions" in out
    assert "PEGAINFER_ALLOW_LONG_MAX_MODEL_LEN" in out
    out = _start_fails(
        "--model-path", tiny_qwen3_dir, "--rope-scaling", '{"rope_type": "dynamic", "factor": 2}'
    )
    assert "rope scaling type 'dynamic' is not supported" in out
    out = _start_fails("--model-path", tiny_qwen3_dir, "--hf-overrides", "max_position_embeddings")
    assert "--hf-overrides is not JSON" in out
