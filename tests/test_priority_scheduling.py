"""--scheduling-policy priority: waiting requests are admitted by priority (lower first), then
arrival; a request short of blocks preempts the lowest-priority, youngest running one. Under
the default first-come-first-served policy, a priority other than 0 is refused."""

from __future__ import annotations

from pegainfer.protocol import RequestRejected, SamplingParams, unpack_ids
from tests.scheduler_sim import Harness, hashed_token, make_config, make_request, reference_output


def admission_order(harness: Harness) -> list[int]:
    """The first prompt token of each new sequence, in the order the plans sent them."""
    return [unpack_ids(s.token_ids)[0] for p in harness.plans for s in p.new_seqs]


def test_fcfs_refuses_a_priority() -> None:
    harness = Harness(make_config(), token_fn=hashed_token)
    rejected = harness.add(make_request("r", [3, 4], priority=2))
    assert isinstance(rejected, RequestRejected)
    assert (rejected.status, rejected.param) == (400, "priority")
    assert harness.add(make_request("ok", [3, 4], priority=0, max_tokens=2)) is None
    harness.run_until_idle()
    harness.assert_drained()


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    config = make_config(max_num_seqs=1, scheduling_policy="priority")
    harness = Harness(config, token_fn=hashed_token)
    # Prompts start with their names' token: 10..14. All wait while "first" runs.
    harness.add(make_request("first", [10, 1], arrival_time=0.0, max_tokens=3))
    harness.plan()
    for token, priority, arrival in ((11, 5, 1.0), (12, 0, 2.0), (13, 3, 3.0), (14, 0, 4.0)):
        harness.add(make_request(f"r{token}", [token, 1], arrival_time=arrival, priority=priority, max_tokens=3))  # fmt: skip
    harness.run_until_idle()
    assert admission_order(harness) == [10, 12, 14, 13, 11]
    harness.assert_drained()


def test_the_lowest_priority_running_request_is_preempted_even_if_older() -> None:
    # 6 blocks of 2 tokens: two requests of up to 10 tokens cannot both run to the end.
    config = make_config(block_size=2, num_kv_blocks=6, scheduling_policy="priority")
    harness = Harness(config, token_fn=hashed_token)
    sampling = dict(max_tokens=6, ignore_eos=True)
    harness.add(make_request("low", [3, 4, 5, 6], arrival_time=1.0, priority=1, **sampling))
    harness.add(make_request("high", [7, 8, 9, 10], arrival_time=2.0, priority=0, **sampling))
    harness.run_until_idle()
    assert harness.scheduler.num_preemptions >= 1
    order = admission_order(harness)
    assert order.count(7) == 1, "the high-priority request is never preempted"
    assert order.count(3) >= 2, "the older, low-priority one was, and came back"
    for request_id, prompt in (("low", [3, 4, 5, 6]), ("high", [7, 8, 9, 10])):
        expected, _, _ = reference_output(prompt, SamplingParams(**sampling), 128)
        assert harness.outputs[request_id] == expected
    harness.assert_drained()
