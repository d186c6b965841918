"""Scheduler properties over random workloads, against a reference with unlimited resources.

The simulated worker asserts the step contract on every plan (budget, max_num_seqs, block
ownership, computed counts, new sequences sent once, finished seqs dropped once); these
tests add that no request is lost, hung or given wrong tokens, and that no block leaks.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from pegainfer.protocol import SamplingParams
from scheduler_proc.block_manager import blocks_for_tokens
from tests.scheduler_sim import Harness, make_config, make_request, reference_output

add_op = st.tuples(
    st.just("add"),
    st.lists(st.integers(3, 99), min_size=1, max_size=20),  # prompt
    st.integers(1, 20),  # max_tokens
    st.integers(0, 4),  # min_tokens
    st.booleans(),  # ignore_eos
    st.lists(st.integers(10, 49), max_size=2),  # stop_token_ids
)
step_op = st.tuples(st.just("step"), st.integers(1, 6))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    cache_tokens=st.integers(12, 96),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    max_model_len=st.integers(8, 64),
    steps_in_flight=st.integers(1, 2),
    enable_prefix_caching=st.booleans(),
    # Results and aborts taken as the process takes them (blocks freed after the outputs
    # are out), the deferred bookkeeping run after each, or left to the next entry point.
    defer=st.booleans(),
    settle=st.booleans(),
    # Weighted towards adds, so that caches fill up and preemption happens often.
    ops=st.lists(st.one_of(add_op, add_op, add_op, step_op, abort_op), min_size=1, max_size=40),
)
def test_random_workloads_finish_every_request_correctly(
    block_size: int,
    cache_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    steps_in_flight: int,
    enable_prefix_caching: bool,
    defer: bool,
    settle: bool,
    ops: list[tuple],
) -> None:
    num_kv_blocks = blocks_for_tokens(cache_tokens, block_size)
    config = make_config(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    harness = Harness(config, steps_in_flight=steps_in_flight, flush_after_plan=settle, defer=defer)
    accepted: dict[str, tuple[list[int], SamplingParams]] = {}
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, min_tokens, ignore_eos, stop_ids = op
            request_id = f"r{len(added)}"
            request = make_request(
                request_id,
                prompt,
                arrival_time=harness.now,
                max_tokens=max_tokens,
                min_tokens=min_tokens,
                ignore_eos=ignore_eos,
                stop_token_ids=stop_ids,
            )
            added.append(request_id)
            rejected = harness.add(request)
            longest = min(len(prompt) + max_tokens, max(max_model_len, len(prompt)))
            never_fits = (
                len(prompt) > max_model_len
                or blocks_for_tokens(longest, block_size) > num_kv_blocks
            )
            assert (rejected is not None) == never_fits
            if rejected is None:
                accepted[request_id] = (prompt, request.sampling)
        elif op[0] == "step":
            for _ in range(op[1]):
                harness.step()
        elif added:
            harness.abort([added[op[1] % len(added)]])
    harness.run_until_idle()

    assert set(harness.finishes) == set(accepted), "every request finishes exactly once"
    for request_id, (prompt, sampling) in accepted.items():
        expected, reason, stop_reason = reference_output(prompt, sampling, max_model_len)
        finish = harness.finishes[request_id]
        got = harness.outputs[request_id]
        if finish.finish_reason == "abort":
            assert got == expected[: len(got)]
        else:
            assert got == expected
            assert (finish.finish_reason, finish.stop_reason) == (reason, stop_reason)
        assert finish.prompt_tokens == len(prompt)
    assert harness.scheduler.generation_tokens_total == sum(map(len, harness.outputs.values()))
    harness.assert_drained()


request_spec = st.tuples(
    st.lists(st.integers(3, 99), min_size=1, max_size=12),  # prompt
    st.integers(4, 16),  # max_tokens
    st.integers(0, 3),  # steps to run before the next request arrives
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    cache_tokens=st.integers(28, 48),
    max_num_batched_tokens=st.integers(4, 16),
    steps_in_flight=st.integers(1, 2),
    defer=st.booleans(),
    specs=st.lists(request_spec, min_size=3, max_size=10),
)
def test_memory_pressure_preempts_and_outputs_stay_the_same(
    block_size: int,
    cache_tokens: int,
    max_num_batched_tokens: int,
    steps_in_flight: int,
    defer: bool,
    specs: list[tuple[list[int], int, int]],
) -> None:
    # Every request fits alone (at most 28 tokens), but not all of them at once.
    config = make_config(
        block_size=block_size,
        num_kv_blocks=blocks_for_tokens(cache_tokens, block_size),
        max_num_batched_tokens=max_num_batched_tokens,
    )
    harness = Harness(config, steps_in_flight=steps_in_flight, defer=defer)
    for index, (prompt, max_tokens, steps) in enumerate(specs):
        assert harness.add(make_request(f"r{index}", prompt, max_tokens=max_tokens)) is None
        for _ in range(steps):
            harness.step()
    harness.run_until_idle()
    target(float(harness.scheduler.num_preemptions), label="preemptions")
    for index, (prompt, max_tokens, _) in enumerate(specs):
        expected, reason, _ = reference_output(prompt, SamplingParams(max_tokens=max_tokens), 128)
        assert harness.outputs[f"r{index}"] == expected
        assert harness.finishes[f"r{index}"].finish_reason == reason
    harness.assert_drained()
