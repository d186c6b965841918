"""Emptying the prefix cache (POST /reset_prefix_cache): through the scheduler and its
simulated worker, and through the served tree."""

from __future__ import annotations

import pytest

from tests.scheduler_sim import Harness, constant, make_config, make_request
from tests.server_util import Server

PREFIX = list(range(20, 32))  # 12 tokens: 3 blocks of 4


def run(harness: Harness, request_id: str, prompt: list[int], **sampling) -> None:
    assert (
        harness.add(make_request(request_id, prompt, arrival_time=harness.now, **sampling)) is None
    )
    harness.run_until_idle()


def test_a_reset_forgets_every_prefix_and_frees_its_blocks() -> None:
    harness = Harness(make_config(block_size=4), token_fn=constant(10))
    run(harness, "a", PREFIX + [1], max_tokens=1)
    run(harness, "salted", PREFIX + [2], max_tokens=1, cache_salt="s")
    scheduler = harness.scheduler
    manager = scheduler.block_manager
    assert len(scheduler.prefix_cache) == 6 and manager.num_cached_blocks == 6
    assert scheduler.reset_prefix_cache() == (6, 6)
    assert len(scheduler.prefix_cache) == 0 and manager.num_cached_blocks == 0
    assert manager.num_free_blocks == manager.num_blocks
    scheduler.prefix_cache.check_invariants()
    run(harness, "b", PREFIX + [1], max_tokens=1)
    assert harness.finishes["b"].cached_tokens == 0
    # Cached again from here on.
    run(harness, "c", PREFIX + [1], max_tokens=1)
    assert harness.finishes["c"].cached_tokens == 12
    harness.assert_drained()


def test_a_reset_under_running_requests_keeps_their_blocks() -> None:
    harness = Harness(make_config(block_size=4), token_fn=constant(10))
    run(harness, "a", PREFIX + [1], max_tokens=1)
    long_prompt = PREFIX + list(range(40, 48))
    assert harness.add(make_request("long", long_prompt, max_tokens=12)) is None
    for _ in range(3):
        harness.step()
    running = harness.scheduler.get_request("long")
    assert running is not None and running.prefix_nodes
    # The running request's own indexed blocks are owned, not freed; the finished one's are.
    entries, freed = harness.scheduler.reset_prefix_cache()
    assert entries >= 5 and freed == 0
    assert all(not node.alive for node in running.prefix_nodes)
    harness.scheduler.prefix_cache.check_invariants()
    harness.run_until_idle()
    assert harness.finishes["long"].completion_tokens == 12
    # What it computed after the reset was not cached: its prefix was gone.
    assert len(harness.scheduler.prefix_cache) == 0
    run(harness, "again", long_prompt, max_tokens=1)
    assert harness.finishes["again"].cached_tokens == 0
    harness.check_invariants()
    harness.assert_drained()


def test_without_a_prefix_cache_there_is_nothing_to_reset() -> None:
    harness = Harness(make_config(block_size=4, enable_prefix_caching=False))
    assert harness.scheduler.reset_prefix_cache() is None


@pytest.mark.slow
def test_the_served_tree_resets_its_prefix_cache(tiny_qwen3_dir, tmp_path) -> None:
    server = Server(
        "--model-path", tiny_qwen3_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", "--block-size", "16",
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip
    prompt = list(range(1000, 1040))  # two full blocks of 16 and some

    def cached() -> int:
        body = {"prompt": prompt, "max_tokens": 1}
        status, out = server.post("/v1/completions", body)
        assert status == 200, out
        return out["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        assert (cached(), cached()) == (0, 32)
        for path in ("/reset_prefix_cache", "/flush_cache"):
            status, out = server.post(path, b"")
            assert status == 200 and out["object"] == "prefix_cache_reset", out
            assert out["enabled"] is True
            assert cached() == 0
        assert out["num_entries"] == 2 and out["num_blocks_freed"] == 2
    finally:
        assert server.stop() == 0, server.log()[-3000:]
        assert server.leftovers() == []
    assert "prefix cache reset: 2 entries forgotten, 2 blocks freed" in server.log()
