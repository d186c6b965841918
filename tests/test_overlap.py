"""Overlapped scheduling: the worker launches step N+1 before step N's tokens are on the
host (reading them from its device slots), and the scheduler keeps two steps in flight and
reconciles stops one step late. Outputs must be the same as with one step in flight.

On the CPU the runner keeps the same code path: a step's tokens reach the host only when
its result is polled, so submitting the next plan first exercises the device-side feed."""

from __future__ import annotations

import random

import pytest
import torch
from worker_helpers import drive, engine_config, greedy_reference, make_tiny_checkpoint

from pegainfer.cli import build_parser, config_from_args
from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    SamplingParams,
    StepPlan,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.main import max_steps_in_flight
from worker_proc.model_runner import ModelRunner

pytest.importorskip("transformers")

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3", seed=21)


@pytest.fixture(scope="module")
def runner(checkpoint) -> ModelRunner:
    return ModelRunner(engine_config(checkpoint, max_num_seqs=8))


def _requests(seed: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    requests = []
    for i in range(8):
        prompt = [rng.randrange(1, 512) for _ in range(rng.randrange(1, 14))]
        max_tokens = rng.randrange(1, 24)
        requests.append((f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    return requests


def test_config_knob():
    on = config_from_args(build_parser().parse_args([]))
    off = config_from_args(build_parser().parse_args(["--no-overlap"]))
    assert not on.no_overlap and off.no_overlap
    assert max_steps_in_flight(on) == 2 and max_steps_in_flight(off) == 1
    on.extra["max_steps_in_flight"] = 3
    assert max_steps_in_flight(on) == 3
    on.extra["max_steps_in_flight"] = True  # not a count
    assert max_steps_in_flight(on) == 2


def test_two_steps_in_flight_give_the_same_greedy_tokens(runner):
    requests = _requests(1)
    one, finish_one, _ = drive(runner, requests, in_flight=1)
    two, finish_two, _ = drive(runner, requests, in_flight=2)
    assert one == two and finish_one == finish_two
    for request_id, _, sampling in requests:
        assert len(one[request_id]) == sampling.max_tokens
    # And both are right: plain greedy decoding of two of them, one forward per token.
    for request_id, prompt, sampling in requests[:2]:
        assert one[request_id] == greedy_reference(runner, prompt, sampling.max_tokens)


def test_stops_found_one_step_late_drop_the_extra_token(runner):
    base = _requests(2)
    free_run, _, _ = drive(runner, base, in_flight=1)
    requests = []
    for request_id, prompt, sampling in base:
        tokens = free_run[request_id]
        if len(tokens) >= 4:  # stop on the token at index 2 (its first occurrence)
            stop = tokens[2]
            sampling = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop])
        requests.append((request_id, prompt, sampling))
    one, finish_one, _ = drive(runner, requests, in_flight=1)
    two, finish_two, scheduler = drive(runner, requests, in_flight=2)
    assert one == two and finish_one == finish_two
    stopped = [rid for rid, _, s in requests if s.stop_token_ids]
    assert len(stopped) >= 3
    for request_id in stopped:
        expected = free_run[request_id]
        cut = expected.index(expected[2]) + 1
        assert two[request_id] == expected[:cut] and finish_two[request_id] == "stop"
    # Every block came back, though the extra in-flight steps wrote past the stops.
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_preemption_and_seeded_sampling_are_reproducible(runner):
    """A small KV cache forces recompute preemptions; greedy and seeded requests give the
    same tokens as with a large cache and one step in flight, since a seeded draw depends
    only on (seed, position)."""
    requests = []
    for i, (request_id, prompt, sampling) in enumerate(_requests(3)):
        if i % 2:
            sampling = SamplingParams(
                temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=sampling.max_tokens
            )
        requests.append((request_id, prompt, sampling))
    roomy, finish_roomy, _ = drive(runner, requests, in_flight=1, num_kv_blocks=200)
    tight, finish_tight, scheduler = drive(runner, requests, in_flight=2, num_kv_blocks=24)
    assert scheduler.num_preemptions > 0
    assert tight == roomy and finish_tight == finish_roomy


def test_logit_edits_survive_preemption_and_overlap(runner):
    """logit_bias and the min_tokens mask give the same tokens with a small KV cache and two
    steps in flight (preempted sequences come back with their output as prompt) as with a
    roomy cache and one step in flight; the mask lifts at each request's min_tokens."""
    plain, _, _ = drive(runner, _requests(4), in_flight=1, num_kv_blocks=200)
    requests = []
    for i, (request_id, prompt, sampling) in enumerate(_requests(4)):
        favourite = plain[request_id][1]
        fields = dict(temperature=0.0, max_tokens=sampling.max_tokens)
        if i % 3 == 0:
            fields.update(logit_bias_ids=[favourite], logit_bias_values=[-100.0])
        elif i % 3 == 1:
            min_tokens = max(2, sampling.max_tokens - 2)
            fields.update(min_tokens=min_tokens, stop_token_ids=[favourite])
        requests.append((request_id, prompt, SamplingParams(**fields)))
    roomy, finish_roomy, _ = drive(runner, requests, in_flight=1, num_kv_blocks=200)
    tight, finish_tight, scheduler = drive(runner, requests, in_flight=2, num_kv_blocks=24)
    assert scheduler.num_preemptions > 0
    assert tight == roomy and finish_tight == finish_roomy
    for i, (request_id, _, sampling) in enumerate(requests):
        if i % 3 == 0:
            assert sampling.logit_bias_ids[0] not in roomy[request_id]
        elif i % 3 == 1:
            assert sampling.stop_token_ids[0] not in roomy[request_id][: sampling.min_tokens - 1]
            assert len(roomy[request_id]) >= sampling.min_tokens


def _plan(step_id, new_seqs=(), seq_ids=(), computed=(), scheduled=(), updates=(), finished=()):
    return StepPlan(
        step_id,
        list(new_seqs),
        pack_ids(list(seq_ids)),
        pack_ids(list(computed)),
        pack_ids(list(scheduled)),
        list(updates),
        pack_ids(list(finished)),
    )


def test_back_to_back_plans_feed_tokens_on_the_device(runner):
    """Plans submitted without polling: each decode reads the token the previous step left
    on the device; results come out in order and match one-plan-at-a-time execution."""
    prompt = [5, 17, 300, 42, 8]

    def plans():
        yield _plan(
            0,
            [NewSequence(1, pack_ids(prompt), GREEDY, 5)],
            [1],
            [0],
            [5],
            [BlockTableUpdate(1, pack_ids([9, 3]))],
        )
        for i in range(5):
            updates = [BlockTableUpdate(1, pack_ids([40 + i]))] if (5 + i) % 4 == 0 else []
            yield _plan(1 + i, seq_ids=[1], computed=[5 + i], scheduled=[1], updates=updates)

    all_plans = list(plans())
    sequential = [unpack_ids(runner.execute(p).token_ids)[0] for p in all_plans]
    runner.execute(_plan(90, finished=[1]))
    assert sequential == greedy_reference(runner, prompt, 6)

    for p in all_plans:
        runner.submit(p)
    # Nothing was copied back: every decode read its input on the device.
    assert runner.seqs[1].num_tokens == 11 and len(runner.seqs[1].token_ids) == 5
    results = runner.poll_results()
    assert [r.step_id for r in results] == list(range(6))
    assert [unpack_ids(r.token_ids)[0] for r in results] == sequential
    assert runner.seqs[1].token_ids == prompt + sequential
    # A plan that recomputes two unresolved tokens forces the copy back, then runs.
    runner.execute(_plan(91, finished=[1]))
    runner.submit(all_plans[0])
    runner.submit(all_plans[1])
    runner.submit(_plan(2, seq_ids=[1], computed=[5], scheduled=[2]))  # rewrites 5..6
    results = runner.poll_results()
    assert [r.step_id for r in results] == [0, 1, 2]
    assert [unpack_ids(r.token_ids)[0] for r in results] == sequential[:3]
    runner.execute(_plan(92, finished=[1]))


def test_penalised_rows_stay_in_flight(runner, monkeypatch):
    """Penalties count the tokens still in flight on the device: two steps in flight give
    the tokens of one, and the runner never waits for a step's tokens to apply them."""
    penalised = SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=12)
    requests = [("p", [7, 7, 7], penalised), ("g", [1, 2, 3, 4], GREEDY)]
    one, _, _ = drive(runner, requests, in_flight=1)
    waits = []
    original = runner._copy_back_all
    monkeypatch.setattr(runner, "_copy_back_all", lambda: (waits.append(1), original())[1])
    two, _, _ = drive(runner, requests, in_flight=2)
    assert one == two and len(one["p"]) == 12
    assert waits == []
    # A strong frequency penalty avoids repeats that plain greedy decoding makes.
    plain, _, _ = drive(
        runner, [("p", [7, 7, 7], SamplingParams(temperature=0.0, max_tokens=12))], 1
    )
    assert one["p"] != plain["p"]


def test_execute_refuses_while_steps_are_pending(runner):
    runner.submit(
        _plan(
            0,
            [NewSequence(3, pack_ids([1, 2]), GREEDY, 2)],
            [3],
            [0],
            [2],
            [BlockTableUpdate(3, pack_ids([0]))],
        )
    )
    with pytest.raises(RuntimeError, match="idle"):
        runner.execute(_plan(1, seq_ids=[3], computed=[2], scheduled=[1]))
    assert runner.oldest_pending_step_id == 0
    (result,) = runner.poll_results(wait=True)
    assert result.step_id == 0 and not runner.has_pending()
    runner.execute(_plan(2, finished=[3]))


def test_slot_table_grows_past_max_num_seqs(runner):
    """More live sequences than max_num_seqs (a scheduler may drop them a step late)."""
    capacity = runner.slots.capacity
    count = capacity + 3
    new = [NewSequence(100 + i, pack_ids([i + 1, i + 2]), GREEDY, 2) for i in range(count)]
    updates = [BlockTableUpdate(100 + i, pack_ids([i])) for i in range(count)]
    ids = [100 + i for i in range(count)]
    first = runner.execute(_plan(0, new, ids, [0] * count, [2] * count, updates))
    assert runner.slots.capacity >= count
    second = runner.execute(_plan(1, seq_ids=ids, computed=[2] * count, scheduled=[1] * count))
    firsts = unpack_ids(first.token_ids)
    for i in (0, count - 1):
        assert [firsts[i], unpack_ids(second.token_ids)[i]] == greedy_reference(
            runner, [i + 1, i + 2], 2
        )
    runner.execute(_plan(2, finished=ids))
    assert runner.slots.num_free == runner.slots.capacity
    assert torch.all(runner.slots.block_tables[runner.slots.scratch_slot] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlap_on_cuda(checkpoint):
    """The real asynchronous path: pinned copies and events, CUDA graphs, a tight KV cache
    (preemptions), greedy and seeded requests: two steps in flight give the tokens of one."""
    config = engine_config(checkpoint, max_num_seqs=8, kv_cache_memory=64 << 20)
    config.device = "cuda"
    runner = ModelRunner(config)
    assert runner.graphs is not None
    requests = []
    for i, (request_id, prompt, sampling) in enumerate(_requests(5)):
        if i % 2:
            sampling = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20)
        requests.append((request_id, prompt, sampling))
    one = drive(runner, requests, in_flight=1, num_kv_blocks=200)[:2]
    two, finish, scheduler = drive(runner, requests, in_flight=2, num_kv_blocks=24)
    assert scheduler.num_preemptions > 0
    assert (two, finish) == one
