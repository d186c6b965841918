"""Golden tests: greedy tokens through the real process tree equal HF transformers' greedy
`generate`, for the tiny random Qwen3 and Qwen3 MoE and for the real SmolLM2."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.hf_reference import hf_greedy
from tests.server_util import Server

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours:",
    "1, 2, 3, 4,",
]


def _hf_greedy(model_dir: str, prompt_ids: list[list[int]]) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return [hf_greedy(model, ids, NUM_TOKENS) for ids in prompt_ids]


def _serve_and_generate(model_dir: str, tmp_path) -> tuple[list[int], list[list[int]]]:
    server = Server(
        "--model-path",
        model_dir,
        "--kv-cache-memory",
        "128MiB",
        "--max-model-len",
        "512",
        "--dtype",
        "float32",
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()

    def run(prompt: str) -> tuple[int, list[int]]:
        status, body = server.post(
            "/v1/completions",
            {
                "prompt": prompt,
                "max_tokens": NUM_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
        )
        assert status == 200, body
        return body["usage"]["prompt_tokens"], body["choices"][0]["token_ids"]

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(run, PROMPTS))
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []
    return [r[0] for r in results], [r[1] for r in results]


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir", "smollm2_dir"])
def test_greedy_tokens_match_transformers(model_fixture, request, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    prompt_lens, ours = _serve_and_generate(model_dir, tmp_path)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [hf_tokenizer(prompt)["input_ids"] for prompt in PROMPTS]
    assert prompt_lens == [len(ids) for ids in prompt_ids]
    reference = _hf_greedy(model_dir, prompt_ids)
    for prompt, got, want in zip(PROMPTS, ours, reference):
        assert len(want) == NUM_TOKENS
        assert got == want, f"{prompt!r}: {got} != {want}"
