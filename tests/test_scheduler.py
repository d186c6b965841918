"""The scheduling policy, driven by a simulated worker (tests/scheduler_sim.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pegainfer.config import EngineConfig
from pegainfer.protocol import (
    RequestRejected,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import (
    EOS,
    Harness,
    TokenFn,
    constant,
    hashed_token,
    make_config,
    make_request,
    reference_output,
    scripted,
)


def run_one(config: EngineConfig, token_fn: TokenFn, prompt_len: int = 5, **sampling):
    harness = Harness(config, token_fn=token_fn)
    assert harness.add(make_request("r", list(range(3, 3 + prompt_len)), **sampling)) is None
    harness.run_until_idle()
    harness.assert_drained()
    return harness.outputs["r"], harness.finishes["r"]


# -- stop conditions ------------------------------------------------------------------------


def test_eos_waits_for_min_tokens() -> None:
    tokens, finish = run_one(make_config(), constant(EOS), min_tokens=3, max_tokens=10)
    assert tokens == [EOS, EOS, EOS]
    assert (finish.finish_reason, finish.stop_reason) == ("stop", None)


def test_eos_stops_at_once_without_min_tokens() -> None:
    tokens, finish = run_one(make_config(), scripted(11, EOS, 12), max_tokens=10)
    assert tokens == [11, EOS]
    assert finish.finish_reason == "stop"
    assert finish.completion_tokens == 2 and finish.prompt_tokens == 5


def test_ignore_eos_runs_to_max_tokens() -> None:
    tokens, finish = run_one(make_config(), constant(EOS), ignore_eos=True, max_tokens=5)
    assert tokens == [EOS] * 5
    assert finish.finish_reason == "length"


def test_max_tokens_gives_length() -> None:
    tokens, finish = run_one(make_config(), constant(10), max_tokens=7)
    assert tokens == [10] * 7
    assert (finish.finish_reason, finish.stop_reason) == ("length", None)


def test_stop_token_id_gives_stop_reason() -> None:
    tokens, finish = run_one(make_config(), scripted(11, 42, 43), stop_token_ids=[42, 43])
    assert tokens == [11, 42]
    assert (finish.finish_reason, finish.stop_reason) == ("stop", 42)


def test_stop_token_id_respects_min_tokens_and_ignore_eos() -> None:
    tokens, finish = run_one(
        make_config(), scripted(42, 11, 42), stop_token_ids=[42], min_tokens=2, ignore_eos=True
    )
    assert tokens == [42, 11, 42]
    assert finish.stop_reason == 42


def test_max_model_len_gives_length() -> None:
    config = make_config(max_model_len=16)
    tokens, finish = run_one(config, constant(10), prompt_len=10, max_tokens=100)
    assert len(tokens) == 6  # prompt + output reach max_model_len
    assert finish.finish_reason == "length"


# -- admission ------------------------------------------------------------------------------


def test_rejects_what_could_never_fit_and_accepts_what_could() -> None:
    scheduler = Scheduler(make_config(num_kv_blocks=4, block_size=4))  # 16 tokens in all
    rejected = scheduler.add_request(make_request("big", list(range(10)), max_tokens=7))
    assert isinstance(rejected, RequestRejected)
    assert rejected.status == 400 and rejected.request_id == "big"
    assert rejected.param == "max_tokens" and "KV cache" in rejected.message
    assert scheduler.add_request(make_request("fits", list(range(10)), max_tokens=6)) is None
    assert not scheduler.get_request("big")
    assert scheduler.num_waiting == 1


def test_max_model_len_caps_what_admission_reserves() -> None:
    scheduler = Scheduler(make_config(num_kv_blocks=4, block_size=4, max_model_len=16))
    assert scheduler.add_request(make_request("r", list(range(10)), max_tokens=1000)) is None


def test_rejects_malformed_requests() -> None:
    scheduler = Scheduler(make_config(max_model_len=16))
    assert scheduler.add_request(make_request("a", [1, 2])) is None
    duplicate = scheduler.add_request(make_request("a", [1, 2]))
    empty = scheduler.add_request(make_request("b", []))
    too_long = scheduler.add_request(make_request("c", list(range(17))))
    no_tokens = scheduler.add_request(make_request("d", [1], max_tokens=0))
    broken = TokenizedRequest("e", b"\x01\x02\x03", SamplingParams(), 0.0)
    assert all(
        isinstance(r, RequestRejected) and r.status == 400
        for r in (duplicate, empty, too_long, no_tokens, scheduler.add_request(broken))
    )
    assert scheduler.num_waiting == 1


# -- chunked prefill and batching -----------------------------------------------------------


def test_chunked_prefill_then_decode() -> None:
    harness = Harness(make_config(max_num_batched_tokens=8), token_fn=constant(10))
    harness.add(make_request("r", list(range(3, 23)), max_tokens=3))  # 20 prompt tokens
    plans = [harness.plan() for _ in range(3)]
    assert [unpack_ids(p.num_computed) for p in plans] == [[0], [8], [16]]
    assert [unpack_ids(p.num_scheduled) for p in plans] == [[8], [8], [4]]
    assert len(plans[0].new_seqs) == 1 and not plans[1].new_seqs and not plans[2].new_seqs
    assert unpack_ids(plans[0].new_seqs[0].token_ids) == list(range(3, 23))
    # Blocks grow with the scheduled tokens, and only new ones travel.
    assert [len(unpack_ids(p.block_updates[0].block_ids)) for p in plans] == [2, 2, 1]
    # Only the step that completes the prompt samples.
    assert [len(unpack_ids(r.token_ids)) for r in harness.pending] == [0, 0, 1]
    for _ in range(3):
        harness.deliver()
    decode = harness.plan()
    assert unpack_ids(decode.num_computed) == [20] and unpack_ids(decode.num_scheduled) == [1]
    assert len(unpack_ids(decode.block_updates[0].block_ids)) == 1  # token 21 opens block 6
    harness.deliver()
    harness.run_until_idle()
    assert harness.outputs["r"] == [10, 10, 10]


def test_decodes_come_first_and_a_new_prompt_gets_the_rest_of_the_budget() -> None:
    harness = Harness(make_config(max_num_batched_tokens=8), token_fn=constant(10))
    harness.add(make_request("a", [5, 6, 7], max_tokens=20))
    harness.step()
    harness.add(make_request("b", list(range(3, 23)), max_tokens=2))
    plan = harness.plan()
    assert unpack_ids(plan.num_scheduled) == [1, 7]
    assert unpack_ids(plan.num_computed) == [3, 0]


def test_max_num_seqs_limits_the_batch() -> None:
    harness = Harness(make_config(max_num_seqs=2), token_fn=constant(10))
    for i in range(4):
        harness.add(make_request(f"r{i}", [3, 4, 5], max_tokens=3, arrival_time=float(i)))
    plan = harness.plan()
    assert len(unpack_ids(plan.seq_ids)) == 2
    assert harness.scheduler.num_running == 2 and harness.scheduler.num_waiting == 2
    harness.run_until_idle()
    assert all(harness.outputs[f"r{i}"] == [10, 10, 10] for i in range(4))


# -- abort and finished seq ids -------------------------------------------------------------


def test_abort_waiting_and_running_requests() -> None:
    harness = Harness(make_config(max_num_seqs=1), token_fn=constant(10))
    harness.add(make_request("a", [3, 4, 5], max_tokens=50))
    harness.add(make_request("b", [3, 4, 5], max_tokens=50))
    harness.step()
    assert harness.scheduler.num_running == 1 and harness.scheduler.num_waiting == 1
    a_seq = unpack_ids(harness.plans[0].seq_ids)[0]

    outputs = harness.abort(["b", "no-such-request"])
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == [
        ("b", "abort", b"")
    ]
    assert harness.scheduler.pending_finished_seq_ids == []  # b never reached a worker

    outputs = harness.abort(["a", "a"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "abort")]
    assert outputs[0].completion_tokens == 1
    assert not harness.scheduler.has_work()
    assert harness.scheduler.schedule() is None
    assert harness.scheduler.block_manager.num_free_blocks == 64

    # The next plan tells the worker to drop a's state, exactly once.
    harness.add(make_request("c", [3, 4], max_tokens=2))
    harness.run_until_idle()
    drops = [unpack_ids(p.finished_seq_ids) for p in harness.plans]
    assert sum(d.count(a_seq) for d in drops) == 1
    assert drops[1] == [a_seq]
    harness.assert_drained()


def test_request_aborted_before_it_arrived_is_dropped() -> None:
    scheduler = Scheduler(make_config())
    assert scheduler.abort(["late"]) == []  # the abort overtook the request
    assert scheduler.add_request(make_request("late", [3, 4])) is None
    assert not scheduler.has_work()
    # Only once: the id is forgotten after that.
    assert scheduler.add_request(make_request("late", [3, 4])) is None
    assert scheduler.num_waiting == 1


def test_finished_seq_ids_reported_once_each() -> None:
    harness = Harness(make_config(), token_fn=hashed_token)
    for i in range(6):
        harness.add(make_request(f"r{i}", [i + 3] * (i + 2), max_tokens=4 + i))
    harness.run_until_idle()
    harness.add(make_request("last", [3], max_tokens=1))
    harness.run_until_idle()
    dropped = [s for p in harness.plans for s in unpack_ids(p.finished_seq_ids)]
    assert len(dropped) == len(set(dropped)) == 6
    harness.assert_drained()


# -- preemption -----------------------------------------------------------------------------


def test_preemption_recomputes_with_prompt_and_output() -> None:
    # 6 blocks of 2 tokens: two requests of up to 10 tokens cannot both run to the end.
    config = make_config(block_size=2, num_kv_blocks=6)
    harness = Harness(config, token_fn=hashed_token)
    sampling = dict(max_tokens=6, ignore_eos=True)
    harness.add(make_request("a", [3, 4, 5, 6], arrival_time=1.0, **sampling))
    harness.add(make_request("b", [7, 8, 9, 10], arrival_time=2.0, **sampling))
    harness.run_until_idle()
    assert harness.scheduler.num_preemptions >= 1

    new_seqs = [s for p in harness.plans for s in p.new_seqs]
    a_seqs = [s for s in new_seqs if unpack_ids(s.token_ids)[:4] == [3, 4, 5, 6]]
    b_seqs = [s for s in new_seqs if unpack_ids(s.token_ids)[:4] == [7, 8, 9, 10]]
    assert len(a_seqs) == 1, "the older request is never the one preempted"
    assert len(b_seqs) >= 2, "b was preempted and came back as a new sequence"
    first, again = b_seqs[0], b_seqs[1]
    assert again.seq_id != first.seq_id
    assert again.num_prompt_tokens == 4
    recomputed = unpack_ids(again.token_ids)
    assert len(recomputed) > 4  # the prompt plus what b had generated
    assert recomputed[4:] == harness.outputs["b"][: len(recomputed) - 4]
    # The old seq was dropped by the plan that preempted it, before the new one appeared.
    drop_plan = next(
        i for i, p in enumerate(harness.plans) if first.seq_id in unpack_ids(p.finished_seq_ids)
    )
    readmit_plan = next(i for i, p in enumerate(harness.plans) if again in p.new_seqs)
    assert drop_plan < readmit_plan
    for request_id, prompt in (("a", [3, 4, 5, 6]), ("b", [7, 8, 9, 10])):
        expected, _, _ = reference_output(prompt, SamplingParams(**sampling), 128)
        assert harness.outputs[request_id] == expected
    harness.assert_drained()


# -- steps in flight ------------------------------------------------------------------------


def test_two_steps_in_flight_drop_the_token_past_a_stop() -> None:
    harness = Harness(make_config(), steps_in_flight=2, token_fn=scripted(11, EOS, 12, 13))
    harness.add(make_request("r", [3, 4, 5], max_tokens=10))
    first = harness.plan()
    second = harness.plan()  # planned before the first result: decodes the pending token
    assert unpack_ids(first.num_scheduled) == [3]
    assert unpack_ids(second.num_computed) == [3] and unpack_ids(second.num_scheduled) == [1]
    assert harness.scheduler.num_steps_in_flight == 2
    harness.deliver()
    third = harness.plan()
    assert unpack_ids(third.num_computed) == [4]
    harness.deliver()  # EOS: the request stops while the third step is in flight
    assert harness.finishes["r"].finish_reason == "stop"
    assert harness.deliver() == []  # the third step's token is dropped
    assert harness.outputs["r"] == [11, EOS]
    assert harness.worker.num_sampled == 3
    harness.run_until_idle()
    harness.assert_drained()


def test_in_flight_steps_never_plan_past_max_tokens() -> None:
    harness = Harness(make_config(), steps_in_flight=2, token_fn=constant(10))
    harness.add(make_request("r", [3, 4, 5], max_tokens=2))
    harness.plan()
    harness.plan()
    assert harness.scheduler.schedule() is None  # both tokens are already in flight
    harness.run_until_idle()
    assert harness.outputs["r"] == [10, 10]
    assert harness.worker.num_sampled == 2


# -- robustness -----------------------------------------------------------------------------


def test_unknown_and_malformed_step_results_do_not_crash() -> None:
    harness = Harness(make_config(), token_fn=constant(10))
    harness.add(make_request("r", [3, 4, 5], max_tokens=5))
    plan = harness.plan()
    harness.pending.clear()
    assert (
        harness.scheduler.on_step_result(StepResult(step_id=999, seq_ids=b"", token_ids=b"")) == []
    )
    bad = StepResult(step_id=plan.step_id, seq_ids=pack_ids([0, 1]), token_ids=pack_ids([10]))
    outputs = harness.scheduler.on_step_result(bad)
    # The request cannot be trusted to match the worker any more: it ends, it does not hang.
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("r", "abort")]
    assert not harness.scheduler.has_work()
    assert harness.scheduler.block_manager.num_free_blocks == 64


def test_stats_count_what_happened() -> None:
    harness = Harness(make_config(), token_fn=constant(10))
    harness.add(make_request("a", [3, 4, 5], max_tokens=4))
    harness.add(make_request("b", [3, 4], max_tokens=2))
    harness.step()
    stats = harness.scheduler.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 0)
    assert stats.kv_cache_usage == 2 / 64
    harness.run_until_idle()
    stats = harness.scheduler.stats()
    assert stats.prompt_tokens_total == 5
    assert stats.generation_tokens_total == 6
    assert stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_light_processes_do_not_import_torch() -> None:
    code = (
        "import sys, scheduler_proc.main, detokenizer_proc.main\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    root = Path(__file__).resolve().parent.parent
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
