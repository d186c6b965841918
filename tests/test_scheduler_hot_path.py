"""The shortcuts of the scheduler's per-step loops hold exactly what they stand in for:

- ``stop_screen`` lets through every token that ``check_stop`` would stop on;
- a result answered in batch order (the loop without per-token bookkeeping) and the same
  result in another order (the checked loop) leave the same requests with the same tokens;
- the prefix cache's per-token test in ``on_step_result`` skips no block ``register``
  would index, and the requests left for ``flush_prefix_cache`` are exactly those whose
  planned tokens complete a block.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegainfer.protocol import SamplingParams, StepResult, pack_ids, unpack_ids
from scheduler_proc.stop import check_stop, stop_screen
from tests.scheduler_sim import Harness, make_config, make_request


@settings(max_examples=400, deadline=None)
@given(
    max_tokens=st.integers(1, 12),
    min_tokens=st.integers(0, 6),
    ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, 9), max_size=3),
    eos=st.frozensets(st.integers(0, 9), max_size=2),
    num_prompt=st.integers(1, 20),
    max_model_len=st.integers(1, 32),
    output=st.lists(st.integers(0, 9), min_size=1, max_size=14),
)
def test_stop_screen_lets_every_stopping_token_through(
    max_tokens, min_tokens, ignore_eos, stop_token_ids, eos, num_prompt, max_model_len, output
):
    sampling = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_token_ids,
    )
    ids, length = stop_screen(sampling, num_prompt, eos, max_model_len)
    if check_stop(sampling, output, num_prompt, eos, max_model_len) is not None:
        assert output[-1] in ids or len(output) >= length


def _workload(seed: int, prefix_caching: bool) -> tuple[Harness, random.Random]:
    rng = random.Random(seed)
    config = make_config(
        block_size=rng.choice([2, 4]),
        num_kv_blocks=rng.choice([20, 64]),
        max_num_seqs=rng.choice([3, 8]),
        max_num_batched_tokens=rng.choice([8, 32]),
        enable_prefix_caching=prefix_caching,
    )
    harness = Harness(config, steps_in_flight=rng.choice([1, 2, 3]))
    shared = [rng.randrange(3, 99) for _ in range(12)]
    for index in range(10):
        prompt = shared[: rng.randrange(1, 13)] + [rng.randrange(3, 99) for _ in range(4)]
        harness.add(
            make_request(
                f"r{index}",
                prompt,
                arrival_time=float(index),
                max_tokens=rng.randrange(1, 16),
                min_tokens=rng.randrange(3),
                ignore_eos=rng.random() < 0.5,
                stop_token_ids=[rng.randrange(10, 50)],
            )
        )
    return harness, rng


def _run(seed: int, reorder: bool) -> dict[str, tuple[list[int], str | None]]:
    """Serve the workload, every result delivered in batch order or shuffled."""
    harness, rng = _workload(seed, prefix_caching=True)
    for _ in range(2000):
        if not harness.scheduler.has_work() and not harness.pending:
            break
        plan = None
        if harness.scheduler.num_steps_in_flight < harness.steps_in_flight:
            plan = harness.plan()
        if harness.pending and (plan is None or len(harness.pending) >= harness.steps_in_flight):
            result = harness.pending.popleft()
            if reorder:
                pairs = list(zip(unpack_ids(result.seq_ids), unpack_ids(result.token_ids)))
                rng.shuffle(pairs)
                result = StepResult(
                    result.step_id,
                    pack_ids([seq_id for seq_id, _ in pairs]),
                    pack_ids([token for _, token in pairs]),
                )
            harness.record(harness.scheduler.on_step_result(result))
    harness.assert_drained()
    return {
        request_id: (tokens, harness.finishes[request_id].finish_reason)
        for request_id, tokens in harness.outputs.items()
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
def test_results_in_any_order_give_the_same_tokens(seed):
    in_order = _run(seed, reorder=False)
    assert in_order and all(reason is not None for _, reason in in_order.values())
    assert _run(seed, reorder=True) == in_order


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000))
def test_prefix_cache_indexing_misses_no_block(seed):
    harness, _ = _workload(seed, prefix_caching=True)
    scheduler = harness.scheduler
    prefix_cache = scheduler.prefix_cache
    assert prefix_cache is not None
    block_size = harness.config.block_size
    for _ in range(2000):
        if not scheduler.has_work() and not harness.pending:
            break
        plan = None
        if scheduler.num_steps_in_flight < harness.steps_in_flight:
            plan = scheduler.schedule()
            if plan is not None:
                planned = [scheduler.request_of_seq(s) for s in unpack_ids(plan.seq_ids)]
                completing = [
                    r
                    for r in planned
                    if r.num_computed_tokens >= (len(r.prefix_nodes) + 1) * block_size
                ]
                assert scheduler._unindexed == completing
                harness.pending.append(harness.worker.execute(plan))
        # Steps stay in flight as the process keeps them: a block's last token may still
        # be on its way when the step computing it is planned.
        if harness.pending and (plan is None or len(harness.pending) >= harness.steps_in_flight):
            harness.deliver()  # it indexes what the last plan completed, then takes tokens
            for request in list(scheduler._running):
                indexed = len(request.prefix_nodes)
                prefix_cache.register(request)  # nothing left to index
                assert len(request.prefix_nodes) == indexed
    harness.assert_drained()
