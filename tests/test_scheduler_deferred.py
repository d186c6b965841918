"""The scheduler's deferred bookkeeping: what the next message out does not need (freeing a
finished request's blocks, indexing a plan's blocks, per-request log lines) runs after that
message is sent, and changes no decision.

- In the process loop, a step's outputs reach the detokenizer socket while the finished
  request still holds its blocks and before its summary is logged; a plan reaches the
  workers before its admission is logged and its blocks are indexed.
- Taking results and aborts through ``apply_*`` and leaving the bookkeeping to the next entry
  point gives exactly the plans and outputs of the eager ``on_step_result``/``abort``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegainfer.protocol import (
    AbortRequests,
    StepPlan,
    StepResult,
    TokenOutputs,
    decode,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.block_manager import blocks_for_tokens
from scheduler_proc.main import SchedulerLoop
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import Harness, make_config, make_request

SCHEDULER_LOGGER = "scheduler_proc.scheduler"


class RecordingSocket:
    """A PUSH socket stand-in: keeps what was sent, and runs ``on_send`` at the moment of
    each send, to look at the scheduler's state then."""

    def __init__(self, on_send: Callable[[bytes], None] = lambda data: None) -> None:
        self.sent: list[bytes] = []
        self.on_send = on_send

    def send(self, data: bytes, copy: bool = True) -> None:
        self.on_send(bytes(data))
        self.sent.append(bytes(data))


def messages(caplog: pytest.LogCaptureFixture, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def test_outputs_leave_before_the_finished_request_is_released(caplog) -> None:
    caplog.set_level(logging.INFO, logger=SCHEDULER_LOGGER)
    config = make_config(block_size=4, num_kv_blocks=32, max_model_len=64)
    scheduler = Scheduler(config)
    manager = scheduler.block_manager
    seen_at_send: dict[str, object] = {}

    def at_plan_send(data: bytes) -> None:
        seen_at_send["admitted"] = messages(caplog, "admitted request")
        seen_at_send["indexed"] = scheduler.prefix_cache.num_indexed_blocks

    def at_outputs_send(data: bytes) -> None:
        seen_at_send["free"] = manager.num_free_blocks
        seen_at_send["finished"] = messages(caplog, "finished request")

    worker = RecordingSocket(at_plan_send)
    detokenizer = RecordingSocket(at_outputs_send)
    loop = SchedulerLoop(scheduler, RecordingSocket(), [worker], detokenizer, RecordingSocket())
    prefix = list(range(10, 26))  # 4 full blocks

    def serve(request_id: str, prompt: list[int]) -> TokenOutputs:
        loop.handle(make_request(request_id, prompt, max_tokens=1))
        loop._plan()
        plan = decode(worker.sent[-1], (StepPlan,))
        sampled = unpack_ids(plan.seq_ids)[-1:]
        loop.handle(StepResult(plan.step_id, pack_ids(sampled), pack_ids([7])))
        return decode(detokenizer.sent[-1], (TokenOutputs,))

    serve("cold", prefix + [40, 41])
    indexed_before = scheduler.prefix_cache.num_indexed_blocks
    free_before = manager.num_free_blocks
    caplog.clear()

    outputs = serve("warm", prefix + [42, 43])

    # The plan went out before its admission was logged and its new block indexed.
    assert seen_at_send["admitted"] == []
    assert seen_at_send["indexed"] == indexed_before
    assert messages(caplog, "admitted request") == [
        "admitted request warm: 18 prompt tokens, 16 cached"
    ]
    # The finishing token went out while the request still held its 5 blocks, unlogged.
    (output,) = outputs.outputs
    assert (output.request_id, output.finish_reason, output.cached_tokens) == ("warm", "length", 16)
    assert unpack_ids(output.new_token_ids) == [7]
    assert seen_at_send["free"] == free_before - 5  # 4 cached blocks taken back, 1 new
    assert seen_at_send["finished"] == []
    # Then released: every block is free or cached again, and the summary is logged.
    assert manager.num_free_blocks == manager.num_blocks
    (summary,) = messages(caplog, "finished request")
    assert summary.startswith("finished request warm: 18 prompt + 1 completion tokens")
    assert scheduler.stats().num_running == 0 and scheduler.pending_finished_seq_ids
    manager.check_invariants()
    scheduler.prefix_cache.check_invariants()


def test_an_abort_leaves_before_the_request_is_released() -> None:
    config = make_config(block_size=4, num_kv_blocks=32)
    scheduler = Scheduler(config)
    free_at_send: list[int] = []
    detokenizer = RecordingSocket(lambda data: free_at_send.append(manager.num_free_blocks))
    manager = scheduler.block_manager
    worker = RecordingSocket()
    loop = SchedulerLoop(scheduler, RecordingSocket(), [worker], detokenizer, RecordingSocket())
    loop.handle(make_request("r", list(range(10, 19)), max_tokens=8))
    loop._plan()
    loop.handle(AbortRequests(["r"]))
    (output,) = decode(detokenizer.sent[-1], (TokenOutputs,)).outputs
    assert output.finish_reason == "abort"
    assert free_at_send == [manager.num_blocks - 3]  # its 3 blocks still held at the send
    assert manager.num_free_blocks == manager.num_blocks


add_op = st.tuples(
    st.just("add"),
    st.integers(0, 1),  # which shared prefix
    st.lists(st.integers(3, 40), max_size=6),  # own suffix
    st.integers(1, 8),  # max_tokens
    st.booleans(),  # ignore_eos
)
step_op = st.tuples(st.just("step"), st.integers(1, 5))
abort_op = st.tuples(st.just("abort"), st.integers(0, 30))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.sampled_from([1, 2, 4]),
    cache_tokens=st.integers(12, 64),
    max_num_seqs=st.integers(1, 5),
    max_num_batched_tokens=st.integers(1, 24),
    steps_in_flight=st.integers(1, 2),
    enable_prefix_caching=st.booleans(),
    settle=st.booleans(),
    prefixes=st.lists(st.lists(st.integers(3, 6), max_size=12), min_size=2, max_size=2),
    ops=st.lists(st.one_of(add_op, add_op, step_op, abort_op), min_size=1, max_size=30),
)
def test_deferred_bookkeeping_changes_no_plan_and_no_output(
    block_size: int,
    cache_tokens: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    steps_in_flight: int,
    enable_prefix_caching: bool,
    settle: bool,
    prefixes: list[list[int]],
    ops: list[tuple],
) -> None:
    config = make_config(
        block_size=block_size,
        num_kv_blocks=blocks_for_tokens(cache_tokens, block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=48,
        enable_prefix_caching=enable_prefix_caching,
    )
    eager = Harness(config, steps_in_flight)
    # Without ``settle`` nothing runs the bookkeeping but the entry points themselves.
    deferred = Harness(config, steps_in_flight, flush_after_plan=settle, defer=True)
    added = 0
    for op in ops:
        for harness in (eager, deferred):
            if op[0] == "add":
                _, which, suffix, max_tokens, ignore_eos = op
                prompt = (prefixes[which] + suffix) or [3]
                request = make_request(
                    f"r{added}", prompt, harness.now, max_tokens=max_tokens, ignore_eos=ignore_eos
                )
                harness.add(request)
            elif op[0] == "step":
                for _ in range(op[1]):
                    harness.step()
            elif added:
                harness.abort([f"r{op[1] % added}"])
        added += op[0] == "add"
        assert deferred.worker.plans == eager.worker.plans
        assert deferred.outputs == eager.outputs and deferred.finishes == eager.finishes
    for harness in (eager, deferred):
        harness.run_until_idle()
    assert deferred.worker.plans == eager.worker.plans
    assert deferred.finishes == eager.finishes
    deferred.scheduler.run_deferred()  # as the process does after its last message
    assert deferred.scheduler.stats() == eager.scheduler.stats()
    for harness in (eager, deferred):
        harness.assert_drained()
