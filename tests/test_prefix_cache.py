"""The prefix cache: entries, hits, sharing, eviction, and its safety against wrong KV.

Driven through the scheduler and the simulated worker (tests/scheduler_sim.py), which models
KV content: reusing a block with the wrong content changes the sampled tokens, and the
strict worker asserts it read its own prefix.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from pegainfer.protocol import SamplingParams, pack_ids, unpack_ids
from scheduler_proc.block_manager import BlockState, blocks_for_tokens
from scheduler_proc.request import Request
from tests.scheduler_sim import (
    Harness,
    SimWorker,
    constant,
    hashed_token,
    make_config,
    make_request,
    reference_output,
)

PREFIX = list(range(20, 32))  # 12 tokens: 3 blocks of 4


def run(harness: Harness, request_id: str, prompt: list[int], **sampling) -> None:
    assert (
        harness.add(make_request(request_id, prompt, arrival_time=harness.now, **sampling)) is None
    )
    harness.run_until_idle()


def new_seq_plan(harness: Harness, request_id_prompt: list[int]):
    """The plan that sent the newest sequence with this prompt, and that sequence."""
    for plan in reversed(harness.plans):
        for new in plan.new_seqs:
            if unpack_ids(new.token_ids)[: len(request_id_prompt)] == request_id_prompt:
                return plan, new
    raise AssertionError("no such sequence was sent")


# -- entries --------------------------------------------------------------------------------


def test_entries_are_per_prefix_not_per_block_content() -> None:
    # The same block of tokens after two different first blocks is two entries, and a
    # request hits only the one under its own first block.
    harness = Harness(make_config(block_size=4), token_fn=constant(10))
    shared = [5, 6, 7, 8]
    run(harness, "a", [1, 1, 1, 1] + shared + [9], max_tokens=1)
    run(harness, "b", [2, 2, 2, 2] + shared + [9], max_tokens=1)
    cache = harness.scheduler.prefix_cache
    assert len(cache) == 4 and set(cache._roots) == {pack_ids([1] * 4), pack_ids([2] * 4)}
    for root in cache._roots.values():
        assert list(root.children) == [pack_ids(shared)]
    run(harness, "c", [2, 2, 2, 2] + shared + [3], max_tokens=1)
    run(harness, "d", [3, 3, 3, 3] + shared + [3], max_tokens=1)
    assert harness.finishes["c"].cached_tokens == 8
    assert harness.finishes["d"].cached_tokens == 0
    cache.check_invariants()
    harness.assert_drained()


def test_request_packed_tokens_equal_packing_the_token_slice() -> None:
    request = Request(
        request_id="r",
        prompt_token_ids=[5, 6, 7, 8, 9],
        prompt_packed=pack_ids([5, 6, 7, 8, 9]),
        sampling=SamplingParams(),
        arrival_time=0.0,
        arrival_index=0,
    )
    request.output_token_ids = [10, 11, 12]
    for start in range(9):
        for end in range(start, 9):
            assert request.packed_tokens(start, end) == pack_ids(request.token_slice(start, end))
    # A prompt_packed that does not match the prompt's length is rebuilt.
    rebuilt = Request("q", [1, 2], SamplingParams(), 0.0, 0, prompt_packed=b"")
    assert rebuilt.prompt_packed == pack_ids([1, 2])


# -- hits -----------------------------------------------------------------------------------


def test_second_request_reuses_the_cached_prefix_and_computes_only_the_rest() -> None:
    harness = Harness(make_config(block_size=4), token_fn=hashed_token)
    run(harness, "a", PREFIX + [40, 41], max_tokens=3)
    computed_before = harness.scheduler.prompt_tokens_computed
    assert computed_before == 14
    a_plan, a_seq = new_seq_plan(harness, PREFIX + [40, 41])
    a_blocks = unpack_ids(a_plan.block_updates[0].block_ids)

    run(harness, "b", PREFIX + [50, 51, 52], max_tokens=3)
    b_plan, b_seq = new_seq_plan(harness, PREFIX + [50, 51, 52])
    row = unpack_ids(b_plan.seq_ids).index(b_seq.seq_id)
    # The whole prompt travels, but its first 12 tokens are computed already.
    assert unpack_ids(b_seq.token_ids) == PREFIX + [50, 51, 52]
    assert unpack_ids(b_plan.num_computed)[row] == 12
    assert unpack_ids(b_plan.num_scheduled)[row] == 3
    b_table = unpack_ids(
        next(u for u in b_plan.block_updates if u.seq_id == b_seq.seq_id).block_ids
    )
    assert b_table[:3] == a_blocks[:3] and len(b_table) == 4
    assert harness.finishes["b"].cached_tokens == 12
    assert harness.finishes["a"].cached_tokens == 0
    assert harness.scheduler.prompt_tokens_computed - computed_before == 3
    assert harness.scheduler.prefix_cache_hits == 12
    assert harness.scheduler.prefix_cache_queries == 14 + 15
    expected, _, _ = reference_output(PREFIX + [50, 51, 52], SamplingParams(max_tokens=3), 128)
    assert harness.outputs["b"] == expected
    harness.assert_drained()


@pytest.mark.parametrize(("prompt_len", "cached"), [(8, 4), (9, 8), (4, 0), (3, 0), (12, 8)])
def test_a_fully_cached_prompt_still_computes_its_last_token(prompt_len: int, cached: int) -> None:
    harness = Harness(make_config(block_size=4), token_fn=constant(10))
    prompt = list(range(3, 3 + prompt_len))
    run(harness, "first", prompt, max_tokens=1)
    run(harness, "again", prompt, max_tokens=2)
    assert harness.finishes["again"].cached_tokens == cached
    assert harness.outputs["again"] == [10, 10]
    harness.assert_drained()


def test_blocks_filled_by_generated_tokens_are_cached_too() -> None:
    # A multi-turn chat: the next turn's prompt is the last prompt plus the answer.
    harness = Harness(make_config(block_size=4), token_fn=hashed_token)
    prompt = [3, 4, 5, 6, 7, 8]
    run(harness, "turn1", prompt, max_tokens=10, ignore_eos=True)
    answer = harness.outputs["turn1"]
    # The KV of the last generated token is never computed: 15 of 16 tokens are, 3 blocks.
    run(harness, "turn2", prompt + answer + [9, 9], max_tokens=2)
    assert harness.finishes["turn2"].cached_tokens == 12
    expected, _, _ = reference_output(prompt + answer + [9, 9], SamplingParams(max_tokens=2), 128)
    assert harness.outputs["turn2"] == expected
    harness.assert_drained()


def test_concurrent_requests_share_blocks_by_reference_count() -> None:
    harness = Harness(make_config(block_size=4, max_num_batched_tokens=64), token_fn=constant(10))
    run(harness, "warm", PREFIX + [1], max_tokens=1)
    for name in ("x", "y"):
        harness.add(make_request(name, PREFIX + [2], max_tokens=5))
    harness.step()
    manager = harness.scheduler.block_manager
    shared = harness.scheduler.get_request("x").block_ids[:3]
    assert harness.scheduler.get_request("y").block_ids[:3] == shared
    assert [manager.ref_count(b) for b in shared] == [2, 2, 2]
    harness.abort(["x"])
    assert [manager.ref_count(b) for b in shared] == [1, 1, 1]
    harness.run_until_idle()
    assert all(manager.state(b) is BlockState.CACHED for b in shared)
    assert harness.outputs["y"] == [10] * 5
    harness.assert_drained()


# -- eviction -------------------------------------------------------------------------------


def test_unreferenced_cached_blocks_are_evicted_least_recently_used_first() -> None:
    # 8 blocks of 4 tokens. Two cached prompts of 2 full blocks each, then a request that
    # needs 6 blocks: only one of the cached prompts can stay, the most recently used one.
    harness = Harness(make_config(block_size=4, num_kv_blocks=8), token_fn=constant(10))
    old, recent = [3] * 8 + [4], [5] * 8 + [6]
    run(harness, "old", old, max_tokens=1)
    run(harness, "recent", recent, max_tokens=1)
    manager = harness.scheduler.block_manager
    assert manager.num_cached_blocks == 4 and manager.num_free_blocks == 8
    run(harness, "big", list(range(10, 31)), max_tokens=3)  # 24 tokens: 6 blocks
    run(harness, "recent again", recent, max_tokens=1)
    run(harness, "old again", old, max_tokens=1)
    assert harness.finishes["recent again"].cached_tokens == 8
    assert harness.finishes["old again"].cached_tokens == 0
    harness.assert_drained()


def test_evicting_a_prefix_drops_every_block_below_it() -> None:
    harness = Harness(make_config(block_size=4, num_kv_blocks=8), token_fn=constant(10))
    run(harness, "a", PREFIX + [1], max_tokens=1)  # 3 full blocks indexed, then cached
    manager = harness.scheduler.block_manager
    cache = harness.scheduler.prefix_cache
    assert cache is not None and len(cache) == 3
    # Make the first block the least recently used, so that it goes first.
    (first_entry,) = cache._roots.values()
    first_block = first_entry.blocks
    (root,) = first_block
    manager._cached.move_to_end(root, last=False)
    taken = manager.allocate(6)  # 5 free blocks, then one eviction: the root
    assert root in taken
    # Its children can never be reached again: they left the index and are plain free.
    assert len(cache) == 0 and manager.num_cached_blocks == 0
    manager.check_invariants()
    cache.check_invariants()
    manager.free(taken)
    run(harness, "a again", PREFIX + [1], max_tokens=1)
    assert harness.finishes["a again"].cached_tokens == 0
    harness.assert_drained()


def test_a_cache_salt_shares_blocks_only_within_the_salt() -> None:
    harness = Harness(make_config(block_size=4, num_kv_blocks=16), token_fn=constant(10))
    run(harness, "plain", PREFIX + [1], max_tokens=1)
    run(harness, "tenant a", PREFIX + [1], max_tokens=1, cache_salt="a")
    run(harness, "tenant b", PREFIX + [1], max_tokens=1, cache_salt="b")
    run(harness, "tenant a again", PREFIX + [2], max_tokens=1, cache_salt="a")
    run(harness, "plain again", PREFIX + [2], max_tokens=1)
    cached = {name: f.cached_tokens for name, f in harness.finishes.items()}
    assert cached == {
        "plain": 0,
        "tenant a": 0,
        "tenant b": 0,
        "tenant a again": 12,
        "plain again": 12,
    }
    cache = harness.scheduler.prefix_cache
    assert len(cache) == 9 and set(cache._salted_roots) == {"a", "b"}
    cache.check_invariants()
    # A salt whose last block is evicted leaves the index.
    manager = harness.scheduler.block_manager
    taken = manager.allocate(manager.num_free_blocks)
    assert len(cache) == 0 and cache._salted_roots == {}
    cache.check_invariants()
    manager.free(taken)
    harness.assert_drained()


def test_a_preempted_request_resumes_from_its_own_cached_blocks() -> None:
    config = make_config(block_size=2, num_kv_blocks=10, max_num_batched_tokens=64)
    harness = Harness(config, token_fn=hashed_token)
    sampling = dict(max_tokens=8, ignore_eos=True)
    harness.add(make_request("a", [3, 4, 5, 6, 7, 8], arrival_time=1.0, **sampling))
    harness.add(make_request("b", [9, 10, 11, 12, 13, 14], arrival_time=2.0, **sampling))
    harness.run_until_idle()
    assert harness.scheduler.num_preemptions >= 1
    # b came back and found (some of) its blocks still cached instead of recomputing them.
    assert harness.worker.num_reused_tokens > 0
    assert harness.worker.num_reused_tokens == harness.scheduler.prefix_cache_hits
    for request_id, prompt in (("a", [3, 4, 5, 6, 7, 8]), ("b", [9, 10, 11, 12, 13, 14])):
        expected, _, _ = reference_output(prompt, SamplingParams(**sampling), 128)
        assert harness.outputs[request_id] == expected
    harness.assert_drained()


def test_disabled_prefix_cache_never_hits_nor_keeps_blocks() -> None:
    harness = Harness(make_config(enable_prefix_caching=False), token_fn=constant(10))
    run(harness, "a", PREFIX + [1], max_tokens=2)
    run(harness, "b", PREFIX + [1], max_tokens=2)
    assert harness.scheduler.prefix_cache is None
    assert harness.finishes["b"].cached_tokens == 0
    assert harness.scheduler.block_manager.num_cached_blocks == 0
    assert harness.scheduler.prompt_tokens_computed == 26
    assert harness.scheduler.prefix_cache_queries == 0
    harness.assert_drained()


def test_aborted_prefill_leaves_its_computed_blocks_cached() -> None:
    harness = Harness(make_config(block_size=4, max_num_batched_tokens=8), token_fn=constant(10))
    harness.add(make_request("a", PREFIX + [1, 2, 3, 4], max_tokens=4))
    harness.step()  # the first 8 prompt tokens: two full blocks
    harness.abort(["a"])
    harness.run_until_idle()
    assert harness.scheduler.block_manager.num_cached_blocks == 2
    run(harness, "b", PREFIX + [1, 2, 3, 4], max_tokens=1)
    assert harness.finishes["b"].cached_tokens == 8
    harness.assert_drained()


# -- the simulated worker catches wrong KV --------------------------------------------------


def test_the_simulated_worker_notices_a_block_of_another_prefix() -> None:
    # Sanity check of the test machinery: give a request a cached block of another prefix
    # by hand and the worker's outputs change (and the strict worker says why).
    for strict in (True, False):
        harness = Harness(make_config(block_size=4), token_fn=hashed_token)
        harness.worker = SimWorker(harness.config, hashed_token, strict=strict)
        run(harness, "a", [3, 4, 5, 6, 7], max_tokens=1)
        cache = harness.scheduler.prefix_cache
        (node,) = cache._roots.values()
        node.tokens = pack_ids([8, 8, 8, 8])  # the entry now claims other tokens
        cache._roots = {node.tokens: node}
        harness.add(make_request("b", [8, 8, 8, 8, 9], max_tokens=3, ignore_eos=True))
        if strict:
            with pytest.raises(AssertionError, match="read KV of another prefix"):
                harness.run_until_idle()
        else:
            harness.run_until_idle()
            expected, _, _ = reference_output(
                [8, 8, 8, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True), 128
            )
            assert harness.outputs["b"] != expected


# -- properties -----------------------------------------------------------------------------

shared_add = st.tuples(
    st.just("add"),
    st.integers(0, 2),  # which shared prefix
    st.lists(st.integers(3, 12), max_size=6),  # own suffix (few values: suffixes collide)
    st.integers(1, 12),  # max_tokens
    st.booleans(),  # ignore_eos
)
step_op = st.tuples(st.just("step"), st.integers(1, 6))
abort_op = st.tuples(st.just("abort"), st.integers(0, 50))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    cache_tokens=st.integers(16, 64),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 24),
    steps_in_flight=st.integers(1, 2),
    flush_after_plan=st.booleans(),
    defer=st.booleans(),
    enable_prefix_caching=st.booleans(),
    prefixes=st.lists(st.lists(st.integers(3, 6), max_size=14), min_size=3, max_size=3),
    ops=st.lists(
        st.one_of(shared_add, shared_add, shared_add, step_op, abort_op), min_size=1, max_size=40
    ),
)
def test_shared_prefix_workloads_match_the_reference(
    block_size: int,
    cache_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    steps_in_flight: int,
    flush_after_plan: bool,
    defer: bool,
    enable_prefix_caching: bool,
    prefixes: list[list[int]],
    ops: list[tuple],
) -> None:
    run_shared_prefix_workload(
        block_size,
        cache_tokens,
        max_num_seqs,
        max_num_batched_tokens,
        steps_in_flight,
        flush_after_plan,
        enable_prefix_caching,
        prefixes,
        ops,
        defer,
    )


def run_shared_prefix_workload(
    block_size: int,
    cache_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    steps_in_flight: int,
    flush_after_plan: bool,
    enable_prefix_caching: bool,
    prefixes: list[list[int]],
    ops: list[tuple],
    defer: bool = False,
) -> None:
    max_model_len = 48
    num_kv_blocks = blocks_for_tokens(cache_tokens, block_size)
    config = make_config(
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
    )
    harness = Harness(config, steps_in_flight, flush_after_plan=flush_after_plan, defer=defer)
    accepted: dict[str, tuple[list[int], SamplingParams]] = {}
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, which, suffix, max_tokens, ignore_eos = op
            prompt = (prefixes[which] + suffix) or [3]
            request_id = f"r{len(added)}"
            request = make_request(
                request_id,
                prompt,
                arrival_time=harness.now,
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
            )
            added.append(request_id)
            if harness.add(request) is None:
                accepted[request_id] = (prompt, request.sampling)
        elif op[0] == "step":
            for _ in range(op[1]):
                harness.step()
        elif added:
            harness.abort([added[op[1] % len(added)]])
    harness.run_until_idle()

    scheduler = harness.scheduler
    target(float(scheduler.prefix_cache_hits), label="prefix cache hit tokens")
    target(float(scheduler.num_preemptions), label="preemptions")
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
    # What the scheduler counts as reused is what the worker found in its blocks.
    assert harness.worker.num_reused_tokens == scheduler.prefix_cache_hits
    assert scheduler.prefix_cache_hits <= scheduler.prefix_cache_queries
    if not enable_prefix_caching:
        assert scheduler.prefix_cache_hits == 0
    harness.assert_drained()
