"""Tensor parallelism on CPU through gloo: the sharded layers give the single-rank logits
and greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from worker_helpers import MiniScheduler, engine_config, make_tiny_checkpoint

from pegainfer.protocol import SamplingParams
from worker_proc.model_runner import ModelRunner

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 99, 300, 7, 42, 1, 256, 511, 0, 17, 64]

# One rank: prefill logits and 6 greedy tokens through chunked plans, saved for the test.
RANK_SCRIPT = """
import sys
import torch
from pegainfer.protocol import SamplingParams
from worker_helpers import MiniScheduler, engine_config
from worker_proc.model_runner import ModelRunner

path, run_dir, tp_size, rank, out = sys.argv[1:6]
torch.set_num_threads(1)
config = engine_config(path, tensor_parallel_size=int(tp_size))
config.run_dir = run_dir
runner = ModelRunner(config, int(rank))
logits = runner.prefill_logits({prompt})
scheduler = MiniScheduler(runner, chunk=4, token_budget=8)
scheduler.add(0, {prompt}, 6, SamplingParams(temperature=0.0))
tokens = scheduler.run()[0]
torch.save(dict(logits=logits, tokens=tokens, kv_heads=runner.kv_spec.num_kv_heads), out)
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tp-qwen3"))
    return make_tiny_checkpoint(path, "qwen3", seed=8, tie_word_embeddings=True)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_matches_single_rank(checkpoint, tmp_path, tp_size):
    # 4 ranks over 2 kv heads exercises kv-head replication.
    single = ModelRunner(engine_config(checkpoint))
    expected = single.prefill_logits(PROMPT)
    scheduler = MiniScheduler(single, chunk=4, token_budget=8)
    scheduler.add(0, PROMPT, 6, SamplingParams(temperature=0.0))
    expected_tokens = scheduler.run()[0]

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(prompt=PROMPT))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]),
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                checkpoint,
                str(run_dir),
                str(tp_size),
                str(rank),
                str(tmp_path / f"rank{rank}.pt"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(tp_size)
    ]
    try:
        for rank, proc in enumerate(procs):
            _, stderr = proc.communicate(timeout=180)
            assert proc.returncode == 0, f"rank {rank} failed:\n{stderr[-3000:]}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank in range(tp_size):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["kv_heads"] == max(1, 2 // tp_size)
        torch.testing.assert_close(result["logits"], expected, rtol=1e-4, atol=1e-4)
        assert result["tokens"] == expected_tokens
