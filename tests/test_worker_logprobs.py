"""Logprobs from the worker: the sampled token's logprob and top-k, and prompt logprobs over
chunked prefill, against a full-sequence reference on the same model (CPU, float32)."""

from __future__ import annotations

import math

import pytest
import torch
from worker_helpers import MiniScheduler, engine_config, make_tiny_checkpoint

from pegainfer.protocol import SamplingParams, unpack_floats, unpack_ids
from worker_proc.cuda_graphs import EagerGraphBackend
from worker_proc.logprobs import top_logprobs
from worker_proc.model_runner import ModelRunner

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3-lp")), "qwen3", seed=5)


@pytest.fixture(scope="module")
def runner(checkpoint) -> ModelRunner:
    return ModelRunner(engine_config(checkpoint))


def run_collecting(runner: ModelRunner, seqs: dict[int, tuple[list[int], int, SamplingParams]]):
    """Drive the runner (chunked prefill of 5 tokens) and keep every result."""
    mini = MiniScheduler(runner, chunk=5, token_budget=12)
    for seq_id, (prompt, max_new, sampling) in seqs.items():
        mini.add(seq_id, prompt, max_new, sampling)
    results = []
    while mini.seqs:
        plan, _ = mini._plan()
        result = runner.execute(plan)
        results.append(result)
        for seq_id, token in zip(unpack_ids(result.seq_ids), unpack_ids(result.token_ids)):
            seq = mini.seqs[seq_id]
            seq.output.append(token)
            seq.length += 1
            if len(seq.output) == seq.max_new:
                mini.finished.append(seq_id)
                mini.free_blocks.extend(seq.blocks)
                del mini.seqs[seq_id]
    return results


def test_top_logprobs_matches_log_softmax():
    logits = torch.randn(3, 50)
    targets = torch.tensor([4, 0, 49])
    chosen, ranks, top_ids, top_values = top_logprobs(logits, targets, 5)
    reference = torch.log_softmax(logits, dim=-1)
    assert torch.allclose(chosen, reference[torch.arange(3), targets])
    order = reference.argsort(dim=-1, descending=True)
    expected_ranks = [order[i].tolist().index(int(targets[i])) + 1 for i in range(3)]
    assert ranks.tolist() == expected_ranks
    assert torch.equal(top_ids, reference.topk(5).indices)
    assert torch.allclose(top_values, reference.topk(5).values)
    _, _, none_ids, none_values = top_logprobs(logits, targets, 0)
    assert none_ids.shape == (3, 0) and none_values.shape == (3, 0)


def test_sampled_and_prompt_logprobs_match_the_full_forward(runner):
    prompt = [7, 3, 99, 250, 11, 42, 8, 17, 300, 5, 61, 2, 90]  # 13 tokens: 3 chunks
    asks = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    results = run_collecting(runner, {1: (prompt, 4, asks), 2: ([5, 6, 7], 4, plain)})

    sampled, prompt_entries = [], []
    for result in results:
        owners = unpack_ids(result.logprob_seq_ids)
        assert set(owners) <= {1}, "only the sequence that asked gets logprobs"
        sampled += [entry for owner, entry in zip(owners, result.logprobs) if owner == 1]
        prompt_owners = unpack_ids(result.prompt_logprob_seq_ids)
        assert set(prompt_owners) <= {1}
        prompt_entries += list(result.prompt_logprobs)
    assert len(sampled) == 4
    output = [unpack_ids(entry.token_ids)[0] for entry in sampled]

    reference = torch.log_softmax(runner.prefill_logits(prompt + output), dim=-1)
    # Sampled tokens: the logprob of the greedy choice is the top-1 logprob.
    for i, entry in enumerate(sampled):
        row = reference[len(prompt) - 1 + i]
        (value,) = unpack_floats(entry.logprobs)
        assert unpack_ids(entry.ranks) == [1]
        top_ids = unpack_ids(entry.top_ids)
        assert entry.num_top == 3 and len(top_ids) == 3
        assert top_ids[0] == output[i] == int(row.argmax())
        assert math.isclose(value, float(row[output[i]]), abs_tol=1e-4)
        assert unpack_floats(entry.top_logprobs) == pytest.approx(
            row.topk(3).values.tolist(), abs=1e-4
        )

    # Prompt: contiguous spans covering every prompt token; the first has no logprob.
    by_position = {}
    for entry in prompt_entries:
        ids = unpack_ids(entry.token_ids)
        values = unpack_floats(entry.logprobs)
        ranks = unpack_ids(entry.ranks)
        for offset, (token, value, rank) in enumerate(zip(ids, values, ranks, strict=True)):
            by_position[entry.start + offset] = (token, value, rank)
        assert entry.num_top == 2
    assert sorted(by_position) == list(range(len(prompt)))
    assert by_position[0][0] == prompt[0] and math.isnan(by_position[0][1])
    for position in range(1, len(prompt)):
        token, value, rank = by_position[position]
        assert token == prompt[position]
        row = reference[position - 1]
        assert math.isclose(value, float(row[token]), abs_tol=1e-4), position
        # Ranks from float32 logprobs of another forward may differ where values nearly tie.
        likelier = int((row > row[token] + 1e-5).sum())
        possibly_likelier = int((row > row[token] - 1e-5).sum()) - 1
        assert likelier + 1 <= rank <= possibly_likelier + 1, position


def test_only_the_prompt_steps_of_a_prompt_logprobs_request_run_eagerly(runner, checkpoint):
    """With graphs, the steps that compute the prompt of a request asking for prompt
    logprobs run eagerly (they need every position's hidden state); its decode steps, and
    the batch's around them, replay graphs. The logprobs are those of the eager runner."""
    backend = EagerGraphBackend()
    graphed = ModelRunner(engine_config(checkpoint, max_num_seqs=4), graph_backend=backend)
    prompt = [7, 3, 99, 250, 11, 42, 8, 17, 300, 5, 61, 2, 90]  # 13 tokens: 3 chunks
    seqs = {
        11: (prompt, 6, SamplingParams(temperature=0.0, logprobs=2, prompt_logprobs=2)),
        12: ([5, 6, 7], 6, SamplingParams(temperature=0.0)),
    }
    replays = backend.num_replays
    got = run_collecting(graphed, seqs)
    # 3 prompt chunks run eagerly; the 5 decode steps of both sequences replay a graph.
    assert backend.num_replays - replays == 5
    want = run_collecting(runner, seqs)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.seq_ids, a.token_ids) == (b.seq_ids, b.token_ids)
        for entries_a, entries_b in (
            (a.logprobs, b.logprobs),
            (a.prompt_logprobs, b.prompt_logprobs),
        ):
            assert len(entries_a) == len(entries_b)
            for x, y in zip(entries_a, entries_b, strict=True):
                assert unpack_ids(x.token_ids) == unpack_ids(y.token_ids)
                assert unpack_ids(x.top_ids) == unpack_ids(y.top_ids)
                assert unpack_floats(x.logprobs) == pytest.approx(
                    unpack_floats(y.logprobs), abs=1e-4, nan_ok=True
                )


def test_no_logprobs_asked_means_none_sent(runner):
    results = run_collecting(runner, {3: ([1, 2, 3, 4], 3, SamplingParams(temperature=0.0))})
    assert all(not r.logprobs and not r.prompt_logprobs for r in results)
    assert len(runner.logprobs) == 0


def test_logprobs_are_raw_before_temperature_and_penalties(runner):
    prompt = [9, 8, 7, 6, 5]
    sampling = SamplingParams(
        temperature=0.7, repetition_penalty=1.8, presence_penalty=1.0, seed=3, max_tokens=3,
        logprobs=2,
    )  # fmt: skip
    results = run_collecting(runner, {4: (prompt, 3, sampling)})
    entries = [entry for result in results for entry in result.logprobs]
    output = [unpack_ids(entry.token_ids)[0] for entry in entries]
    assert len(output) == 3
    reference = torch.log_softmax(runner.prefill_logits(prompt + output), dim=-1)
    for i, entry in enumerate(entries):
        row = reference[len(prompt) - 1 + i]
        (value,) = unpack_floats(entry.logprobs)
        assert math.isclose(value, float(row[output[i]]), abs_tol=1e-4)
        assert unpack_ids(entry.top_ids) == row.topk(2).indices.tolist()


def test_asking_past_the_vocabulary_gets_all_of_it(runner):
    """--max-logprobs -1: a request may ask for more alternatives than the model has tokens."""
    vocab = runner.model_config.vocab_size
    prompt = [7, 3, 99, 250]
    huge = SamplingParams(temperature=0.0, logprobs=2**31 - 1, prompt_logprobs=2**31 - 1)
    results = run_collecting(runner, {41: (prompt, 1, huge)})
    sampled = [entry for result in results for entry in result.logprobs]
    prompt_entries = [entry for result in results for entry in result.prompt_logprobs]
    assert sampled and prompt_entries
    for entry in sampled + prompt_entries:
        n = len(unpack_ids(entry.token_ids))
        assert entry.num_top == vocab and len(unpack_ids(entry.top_ids)) == n * vocab
