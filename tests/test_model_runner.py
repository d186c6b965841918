"""ModelRunner's plan handling and the sampler, on a tiny random Qwen3 (CPU, float32)."""

from __future__ import annotations

import pytest
import torch
from worker_helpers import MiniScheduler, engine_config, make_tiny_checkpoint

from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    SamplingParams,
    StepPlan,
    pack_ids,
    unpack_ids,
)
from worker_proc.device_choice import resolve_device, resolve_dtype
from worker_proc.kv_cache import KVCacheSpec, default_cpu_kv_bytes
from worker_proc.model_runner import ModelRunner, PlanError

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3", seed=11)


@pytest.fixture
def runner(checkpoint) -> ModelRunner:
    return ModelRunner(engine_config(checkpoint))


def plan(
    step_id: int = 0,
    new_seqs=(),
    seq_ids=(),
    num_computed=(),
    num_scheduled=(),
    block_updates=(),
    finished=(),
) -> StepPlan:
    return StepPlan(
        step_id=step_id,
        new_seqs=list(new_seqs),
        seq_ids=pack_ids(list(seq_ids)),
        num_computed=pack_ids(list(num_computed)),
        num_scheduled=pack_ids(list(num_scheduled)),
        block_updates=list(block_updates),
        finished_seq_ids=pack_ids(list(finished)),
    )


def new_seq(seq_id: int, tokens: list[int], sampling: SamplingParams = GREEDY) -> NewSequence:
    return NewSequence(seq_id, pack_ids(tokens), sampling, len(tokens))


def blocks(seq_id: int, ids: list[int]) -> BlockTableUpdate:
    return BlockTableUpdate(seq_id, pack_ids(ids))


# --------------------------------------------------------------------------- runner basics


def test_runner_resolves_cpu_defaults(checkpoint):
    config = engine_config(checkpoint, dtype="auto")
    config.device = "auto"
    runner = ModelRunner(config)
    if not torch.cuda.is_available():
        assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
    assert runner.block_size == 4
    # 1 MiB over 2 layers x (k, v) x 4 tokens x 2 kv heads x 16 dims x element size.
    element = torch.empty((), dtype=runner.dtype).element_size()
    assert runner.num_kv_blocks == (1 << 20) // (2 * 2 * 4 * 2 * 16 * element)
    assert runner.kv_storage.shape == (2, 2, runner.num_kv_blocks, 4, 2, 16)


def test_resolve_device_and_dtype():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int8", torch.device("cpu"))
    with pytest.raises(ValueError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda", 1)
        assert resolve_device("auto") == torch.device("cpu")
    else:
        assert resolve_device("cuda", 1) == torch.device("cuda", 1)
        assert resolve_device("cuda:2", 1) == torch.device("cuda", 3)


def test_kv_cache_too_small_for_max_model_len_fails_clearly(checkpoint):
    config = engine_config(checkpoint, kv_cache_memory=2048 * 10, max_model_len=128)
    with pytest.raises(RuntimeError, match="holds 40 tokens, fewer than --max-model-len 128"):
        ModelRunner(config)


def test_default_cpu_kv_size_is_capped_by_need():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)

    class Config:
        max_num_seqs = 3
        max_model_len = 10

    # 3 sequences of 10 tokens need 3 blocks each.
    assert default_cpu_kv_bytes(Config, spec) == 9 * spec.bytes_per_block
    Config.max_num_seqs, Config.max_model_len = 256, 1 << 20
    assert default_cpu_kv_bytes(Config, spec) == 1 << 30


# --------------------------------------------------------------------------- execute


def test_chunked_prefill_samples_only_when_the_prompt_is_done(runner):
    prompt = [5, 17, 300, 42, 8, 99, 7]
    reference = runner.prefill_logits(prompt)[-1].argmax().item()
    first = runner.execute(plan(0, [new_seq(1, prompt)], [1], [0], [4], [blocks(1, [7])]))
    assert first.step_id == 0 and first.seq_ids == b"" and first.token_ids == b""
    second = runner.execute(
        plan(1, seq_ids=[1], num_computed=[4], num_scheduled=[3], block_updates=[blocks(1, [3])])
    )
    assert unpack_ids(second.seq_ids) == [1]
    assert unpack_ids(second.token_ids) == [reference]
    assert runner.seqs[1].token_ids == prompt + [reference]
    # The decode input is the token the worker sampled itself.
    third = runner.execute(
        plan(2, seq_ids=[1], num_computed=[7], num_scheduled=[1], block_updates=[blocks(1, [12])])
    )
    expected = runner.prefill_logits(prompt + [reference])[-1].argmax().item()
    assert unpack_ids(third.token_ids) == [expected]


def test_results_list_sampling_sequences_in_batch_order(runner):
    runner.execute(
        plan(
            0,
            [new_seq(9, [1, 2, 3]), new_seq(4, [4, 5, 6, 7, 8, 9]), new_seq(6, [10])],
            [9, 4, 6],
            [0, 0, 0],
            [3, 2, 1],
            [blocks(9, [0]), blocks(4, [1, 2]), blocks(6, [3])],
        )
    )
    # 4 is mid-prefill; 9 and 6 sampled. Next step: all three, 4 finishes its prompt.
    result = runner.execute(
        plan(
            1, seq_ids=[6, 4, 9], num_computed=[1, 2, 3], num_scheduled=[1, 4, 1], block_updates=[]
        )
    )
    assert unpack_ids(result.seq_ids) == [6, 4, 9]
    assert len(unpack_ids(result.token_ids)) == 3


def test_finished_sequences_are_freed_and_ids_reusable(runner):
    runner.execute(plan(0, [new_seq(3, [1, 2, 3])], [3], [0], [3], [blocks(3, [5])]))
    assert 3 in runner.seqs
    runner.execute(plan(1, finished=[3]))
    assert runner.seqs == {}
    # Unknown finished ids are ignored; the id can come back as a new sequence.
    result = runner.execute(
        plan(2, [new_seq(3, [9, 9])], [3], [0], [2], [blocks(3, [6])], finished=[77])
    )
    assert unpack_ids(result.seq_ids) == [3]
    assert runner.seqs[3].token_ids[:2] == [9, 9] and runner.seqs[3].block_table == [6]


def test_prefix_cached_sequence_starts_past_zero(runner):
    """A new sequence whose first blocks already hold its prefix's KV (written by another
    sequence) starts with num_computed > 0 and matches a full prefill."""
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 100]
    runner.execute(plan(0, [new_seq(1, prompt)], [1], [0], [10], [blocks(1, [20, 21, 22])]))
    result = runner.execute(
        plan(1, [new_seq(2, prompt[:8] + [5, 6])], [2], [8], [2], [blocks(2, [20, 21, 30])])
    )
    expected = runner.prefill_logits(prompt[:8] + [5, 6])[-1].argmax().item()
    assert unpack_ids(result.token_ids) == [expected]


@pytest.mark.parametrize(
    "bad_plan,message",
    [
        (plan(0, seq_ids=[42], num_computed=[0], num_scheduled=[1]), "unknown sequence 42"),
        (plan(0, [new_seq(1, [1, 2])], [1], [0], [3], [blocks(1, [0])]), "exceeds its 2 known"),
        (plan(0, [new_seq(1, [1] * 6)], [1], [0], [6], [blocks(1, [0])]), "need 2 blocks"),
        (plan(0, [new_seq(1, [1, 2])], [1], [0], [2], [blocks(1, [10**6])]), "block ids outside"),
        (plan(0, [new_seq(1, [1, 2])], block_updates=[blocks(8, [0])]), "unknown sequence 8"),
        (plan(0, [new_seq(1, [1, 2])], [1], [0, 0], [2], [blocks(1, [0])]), "differ in length"),
        (plan(0, [new_seq(1, [1, 2])], [1], [0], [0], [blocks(1, [0])]), "num_scheduled 0"),
        (plan(0, [new_seq(1, [1, 2])], [1, 1], [0, 0], [1, 1], [blocks(1, [0])]), "twice"),
        (plan(0, [new_seq(1, [1, 600])]), "outside \\[0, 512\\)"),
        (plan(0, [new_seq(1, [])]), "no tokens"),
        (plan(0, [new_seq(1, [1]), new_seq(1, [2])]), "already live"),
    ],
)
def test_invalid_plans_raise_clear_errors(runner, bad_plan, message):
    with pytest.raises(PlanError, match=message):
        runner.execute(bad_plan)


def test_seeded_sampling_independent_of_batch_composition(checkpoint):
    seeded = SamplingParams(temperature=1.0, seed=1234)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]

    def generate(with_company: bool) -> list[int]:
        runner = ModelRunner(engine_config(checkpoint))
        scheduler = MiniScheduler(runner, chunk=3, token_budget=9, seed=int(with_company))
        if with_company:
            scheduler.add(1, [7, 7, 7, 7, 7], 12, SamplingParams(temperature=0.8))
            scheduler.add(2, [100, 200], 12, SamplingParams(temperature=1.0, seed=99))
        scheduler.add(5, prompt, 12, seeded)
        if with_company:
            scheduler.add(3, [1, 2, 3], 12, GREEDY)
        return scheduler.run()[5]

    alone = generate(False)
    assert alone == generate(True)
    # A different seed gives a different continuation (12 tokens from 512: no chance tie).
    runner = ModelRunner(engine_config(checkpoint))
    scheduler = MiniScheduler(runner)
    scheduler.add(5, prompt, 12, SamplingParams(temperature=1.0, seed=4321))
    assert scheduler.run()[5] != alone


# --------------------------------------------------------------------------- sampling


def test_runner_keeps_penalised_rows_token_counts(runner):
    """A penalised sequence's row of the penalty table holds its prompt as seen and its
    generated tokens as counts (a preempted sequence's earlier output among them), counts
    each token the runner samples for it, and is released when the sequence finishes."""
    table = runner.penalties
    assert table is not None and table.rows_in_use == 0
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    resumed = NewSequence(1, pack_ids([5, 17, 300, 42, 9]), penalised, num_prompt_tokens=3)
    first = runner.execute(plan(0, [resumed], [1], [0], [5], [blocks(1, [0, 1])]))
    row = runner.seqs[1].penalty_row
    assert row >= 0 and table.rows_in_use == 1
    token = unpack_ids(first.token_ids)[0]
    second = runner.execute(plan(1, [new_seq(2, [8, 8])], [1, 2], [5, 0], [1, 2], [blocks(2, [2])]))
    token2 = unpack_ids(second.token_ids)[0]  # sequence 1's, first in the batch
    assert runner.seqs[2].penalty_row == -1  # no penalty: no row
    assert table.prompt_seen[row].nonzero().flatten().tolist() == [5, 17, 300]
    expected = torch.bincount(torch.tensor([42, 9, token, token2]), minlength=table.vocab_size)
    assert torch.equal(table.counts[row].long(), expected)
    runner.execute(plan(2, seq_ids=[2], num_computed=[2], num_scheduled=[1], finished=[1]))
    assert table.rows_in_use == 0
