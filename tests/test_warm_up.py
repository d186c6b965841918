"""The start-up warm-up (worker_proc/warm_up.py): throwaway requests through the runner's
step path leave it as it was, so that what it serves afterwards is what a runner that never
warmed up serves, unseeded sampling included."""

from __future__ import annotations

import pytest
import torch
from worker_helpers import drive, engine_config, greedy_reference, make_tiny_checkpoint

from pegainfer.protocol import SamplingParams
from worker_proc import warm_up
from worker_proc.model_runner import ModelRunner

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3", seed=5)


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    return [
        ("greedy", [5, 9, 2, 77, 31], SamplingParams(temperature=0.0, max_tokens=9)),
        ("seeded", [8, 1, 4], SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=9)),
        ("unseeded", [40, 41, 42, 43], SamplingParams(temperature=1.0, max_tokens=9)),
        (
            "penalised",
            [3, 3, 3, 6],
            SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=9),
        ),
    ]


class CountingRunner(ModelRunner):
    """Records every plan the warm-up submits."""

    def submit(self, plan):  # noqa: ANN001 - the parent's signature
        self.plans = [*getattr(self, "plans", []), plan]
        super().submit(plan)


# The server's defaults from a model's generation_config.json: none, or Qwen3's with a
# repetition penalty (the top-k candidate path and the penalty table).
QWEN3_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}


@pytest.mark.parametrize(
    ("max_num_seqs", "defaults"), [(1, {}), (2, {}), (8, {}), (2, QWEN3_DEFAULTS)]
)
def test_warm_up_leaves_the_runner_as_it_was(checkpoint, max_num_seqs, defaults):
    config = engine_config(checkpoint, max_num_seqs=max_num_seqs, sampling_defaults=defaults)
    cold = ModelRunner(config)
    warm = CountingRunner(
        engine_config(checkpoint, max_num_seqs=max_num_seqs, sampling_defaults=defaults)
    )
    capacity = warm.slots.capacity

    assert warm_up.warm_up_step_path(warm) > 0
    assert not warm.seqs and not warm.has_pending()
    assert warm.slots.capacity == capacity and warm.slots.num_free == capacity
    # Both sampling paths ran, and a mixed step where the batch has room for one.
    sampled = [n.sampling for p in warm.plans for n in p.new_seqs]
    samplings = warm_up.warm_up_samplings(defaults)
    assert all(s in sampled for s in samplings)
    assert (samplings[1].top_k == 20) == bool(defaults)
    mixed = any(p.new_seqs and len(p.seq_ids) > 4 * len(p.new_seqs) for p in warm.plans)
    assert mixed == (max_num_seqs > 1)

    requests = _requests()
    expected = drive(cold, requests, in_flight=2, max_num_seqs=max_num_seqs)[:2]
    assert drive(warm, requests, in_flight=2, max_num_seqs=max_num_seqs)[:2] == expected
    assert all(len(tokens) == 9 for tokens in expected[0].values())


def test_the_warm_up_samples_plainly_where_the_defaults_are_greedy():
    greedy, sampled = warm_up.warm_up_samplings({"temperature": 0.0, "top_k": 20})
    assert greedy.temperature == 0.0
    assert sampled == warm_up.PLAIN_SAMPLED and sampled.temperature == 1.0


def test_warm_up_skipped_when_the_kv_cache_is_too_small(checkpoint):
    # 5 blocks of 4 tokens: one 12-token prompt and its two samples need 4 blocks, a
    # group and the mixed step's extra sequence 8.
    config = engine_config(checkpoint, max_num_seqs=2)
    runner = ModelRunner(config)
    runner.num_kv_blocks = 5
    assert warm_up.warm_up_step_path(runner) == 0.0
    assert not runner.seqs and not runner.has_pending()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_runner_warms_up_at_start(checkpoint):
    """On a GPU the runner warms up by itself, with its graphs, and serves as before: the same
    requests after a second warm-up give the same tokens, unseeded ones included."""
    config = engine_config(checkpoint, max_num_seqs=8)
    config.device = "cuda"
    runner = ModelRunner(config)
    assert runner.graphs is not None and runner.prefill_graphs is not None
    assert "warm-up" in [phase for phase, _ in runner.timeline.phases]
    assert not runner.seqs and runner.slots.num_free == runner.slots.capacity
    requests = _requests()
    served = drive(runner, requests, in_flight=2)[:2]
    assert warm_up.warm_up_step_path(runner) > 0
    assert drive(runner, requests, in_flight=2)[:2] == served
    prompt, sampling = requests[0][1], requests[0][2]
    assert served[0]["greedy"] == greedy_reference(runner, prompt, sampling.max_tokens)
