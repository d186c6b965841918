"""Golden tests on CUDA in bfloat16 (skipped without a GPU).

bfloat16 rounding differs between any two implementations, so the reference for error is HF
transformers in float32 on the same GPU: pegainfer's bf16 logits may be at most about as far
from it as HF's own bf16 logits are. Greedy tokens through the real process tree must equal
HF's bf16 greedy tokens, except after a near-tie, where either choice is within rounding.
"""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pegainfer.config import EngineConfig, finalize, read_model_info
from tests.hf_reference import hf_greedy
from tests.server_util import Server

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NUM_TOKENS = 32
# A divergence after a gap this small between the two top logits (in float32) is rounding.
NEAR_TIE = 0.25
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three colours:",
]


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    # The server under test sizes its KV cache from the GPU memory that is free, so nothing
    # of an earlier test in this process may stay cached on the device.
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _hf(model_dir: str, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to("cuda").eval()


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3_dir", "smollm2_dir"])
def test_bf16_logits_on_cuda(model_fixture, request):
    from worker_proc.model_runner import ModelRunner

    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    config = finalize(
        EngineConfig(
            model_path=model_dir,
            served_model_name="golden",
            device="cuda",
            dtype="bfloat16",
            max_model_len=512,
            gpu_memory_utilization=0.3,
            model=read_model_info(model_dir),
        )
    )
    runner = ModelRunner(config)
    hf32, hf16 = _hf(model_dir, torch.float32), _hf(model_dir, torch.bfloat16)
    ours_errors, hf_errors = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        ours = runner.prefill_logits(ids).float().cuda()
        with torch.no_grad():
            input_ids = torch.tensor([ids], device="cuda")
            ref32 = hf32(input_ids).logits[0].float()
            ref16 = hf16(input_ids).logits[0].float()
        assert not torch.isnan(ours).any()
        ours_err, hf_err = _relative_error(ours, ref32), _relative_error(ref16, ref32)
        print(f"{model_fixture} {prompt!r}: rel err ours {ours_err:.2e}, HF bf16 {hf_err:.2e}")
        ours_errors.append(ours_err)
        hf_errors.append(hf_err)
        assert ours_err < 5e-2  # bfloat16 level, per prompt
        agree = (ours.argmax(-1) == ref32.argmax(-1)).float().mean().item()
        assert agree >= 0.9
    # Per prompt, bf16 noise varies by a few times either way; on average pegainfer is
    # as close to float32 as HF's own bf16 path.
    mean_ours, mean_hf = sum(ours_errors) / len(PROMPTS), sum(hf_errors) / len(PROMPTS)
    print(f"{model_fixture}: mean rel err ours {mean_ours:.2e}, HF bf16 {mean_hf:.2e}")
    assert mean_ours <= 1.5 * mean_hf + 2e-3
    del runner, hf32, hf16


def _serve_greedy(model_dir: str, tmp_path) -> tuple[list[list[int]], list]:
    """Each prompt's greedy tokens, and the first prompt's ``prompt_logprobs`` (top 5)."""
    server = Server(
        "--model-path",
        model_dir,
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--gpu-memory-utilization",
        "0.5",
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()

    def run(prompt: str) -> list[int]:
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
        return body["choices"][0]["token_ids"]

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            greedy = list(pool.map(run, PROMPTS))
        status, body = server.post(
            "/v1/completions",
            {"prompt": PROMPTS[0], "max_tokens": 1, "prompt_logprobs": 5},
        )
        assert status == 200, body
        return greedy, body["choices"][0]["prompt_logprobs"]
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        assert server.leftovers() == []


@pytest.mark.parametrize("model_fixture", ["tiny_qwen3_dir", "smollm2_dir"])
def test_bf16_greedy_through_the_process_tree_on_cuda(model_fixture, request, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    ours, prompt_logprobs = _serve_greedy(model_dir, tmp_path)
    hf16, hf32 = _hf(model_dir, torch.bfloat16), _hf(model_dir, torch.float32)
    _check_prompt_logprobs(prompt_logprobs, tokenizer(PROMPTS[0])["input_ids"], hf32)
    exact = 0
    for prompt, got in zip(PROMPTS, ours):
        ids = tokenizer(prompt)["input_ids"]
        want = hf_greedy(hf16, ids, NUM_TOKENS)
        assert len(got) == NUM_TOKENS
        if got == want:
            exact += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
        with torch.no_grad():
            context = torch.tensor([ids + got[:first]], device="cuda")
            logits = hf32(context).logits[0, -1].float()
        gap = (logits[want[first]] - logits[got[first]]).abs().item()
        print(f"{model_fixture} {prompt!r}: diverges at {first} with float32 gap {gap:.3f}")
        assert gap < NEAR_TIE, (prompt, first, got, want)
    print(f"{model_fixture}: {exact}/{len(PROMPTS)} prompts identical for {NUM_TOKENS} tokens")


def _check_prompt_logprobs(got: list, ids: list[int], hf32) -> None:
    """The served bf16 prompt logprobs against HF's float32 ones: each value within bf16's
    rounding, each rank consistent with the top five it came with (bf16 logits tie often)."""
    with torch.no_grad():
        reference = torch.log_softmax(hf32(torch.tensor([ids], device="cuda")).logits[0], -1)
    assert len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        entry = dict(got[position])
        own = entry.pop(str(ids[position]))
        want = reference[position - 1, ids[position]].item()
        assert abs(own["logprob"] - want) < 0.1 + 0.02 * abs(want), (position, own, want)
        ranks = [value["rank"] for value in entry.values()]
        values = [value["logprob"] for value in entry.values()]
        assert len(entry) in (4, 5) and set(ranks) <= {1, 2, 3, 4, 5}
        assert values == sorted(values, reverse=True) and ranks == sorted(set(ranks))
        # Rank r: exactly r - 1 tokens of the vocabulary are likelier.
        likelier = sum(value > own["logprob"] for value in values)
        assert likelier == min(own["rank"] - 1, len(values)), (position, own, entry)
