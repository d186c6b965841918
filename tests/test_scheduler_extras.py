"""What the scheduler process adds around the policy: first-output sampling settings, queue
times and logprobs on outputs, stats publication, and the step watchdog."""

from __future__ import annotations

from pegainfer.protocol import (
    EngineStats,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenLogprobs,
    pack_ids,
    unpack_ids,
)
from scheduler_proc.monitor import StatsPublisher, StepClock, StepWatchdog
from scheduler_proc.output_extras import OutputExtras, detokenizer_needs
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import make_config, make_request


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(k: int = 0, start: int = 0) -> TokenLogprobs:
    return TokenLogprobs(start, pack_ids([5]), b"\x00\x00\x80\xbf", k, b"", b"")


def run_step(scheduler: Scheduler, plan: StepPlan, token: int, **logprob_fields) -> StepResult:
    samplers = unpack_ids(plan.seq_ids)
    return StepResult(
        plan.step_id, pack_ids(samplers), pack_ids([token] * len(samplers)), **logprob_fields
    )


def test_only_requests_whose_text_depends_on_settings_carry_them():
    assert not detokenizer_needs(SamplingParams())
    assert detokenizer_needs(SamplingParams(stop=["x"]))
    assert detokenizer_needs(SamplingParams(skip_special_tokens=False))
    assert detokenizer_needs(SamplingParams(logprobs=0))
    assert detokenizer_needs(SamplingParams(starts_in_reasoning=True))


def test_first_output_carries_sampling_and_queue_time_once():
    clock = Clock()
    extras = OutputExtras(clock)
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("a", [3, 4, 5], arrival_time=99.0, max_tokens=3, stop=["x"]))
    scheduler.add_request(make_request("b", [3, 4], arrival_time=99.5, max_tokens=3))
    extras.on_admitted("a", scheduler.get_request("a").sampling)
    extras.on_admitted("b", scheduler.get_request("b").sampling)
    plan = scheduler.schedule()
    extras.on_planned([scheduler.request_of_seq(new.seq_id) for new in plan.new_seqs])
    outputs = extras.decorate(scheduler.on_step_result(run_step(scheduler, plan, 7)))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["a"].sampling.stop == ["x"] and by_id["b"].sampling is None
    assert by_id["a"].queue_time == 1.0 and by_id["b"].queue_time == 0.5
    plan = scheduler.schedule()
    outputs = extras.decorate(scheduler.on_step_result(run_step(scheduler, plan, 8)))
    assert all(o.sampling is None and o.queue_time is None for o in outputs)
    assert extras.num_pending == 0


def test_an_aborted_request_still_clears_its_pending_settings():
    extras = OutputExtras(Clock())
    scheduler = Scheduler(make_config())
    scheduler.add_request(make_request("w", [3, 4], max_tokens=3, stop=["x"]))
    extras.on_admitted("w", scheduler.get_request("w").sampling)
    outputs = extras.decorate(scheduler.abort(["w"]))
    assert outputs[0].finish_reason == "abort" and outputs[0].sampling is not None
    assert extras.num_pending == 0


def test_logprobs_go_to_their_request_and_prompt_spans_get_an_output():
    extras = OutputExtras(Clock())
    scheduler = Scheduler(make_config(max_num_batched_tokens=4))
    scheduler.add_request(make_request("p", list(range(3, 9)), max_tokens=2, prompt_logprobs=1))
    scheduler.add_request(make_request("q", [3, 4], max_tokens=2, logprobs=0))
    first = scheduler.schedule()  # "p" prefills 4 of its 6 tokens: nothing sampled for it
    seq_p = scheduler.get_request("p").seq_id
    assert unpack_ids(first.seq_ids) == [seq_p]
    result = StepResult(first.step_id, b"", b"")
    result.prompt_logprob_seq_ids = pack_ids([seq_p])
    result.prompt_logprobs = [record(1, start=0)]
    owners = extras.owners(result, scheduler.request_of_seq)
    outputs = extras.decorate(scheduler.on_step_result(result), result, owners)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("p", b"")]
    assert outputs[0].prompt_logprobs.num_top == 1

    second = scheduler.schedule()  # the rest of "p" and all of "q": both sample
    seq_q = scheduler.get_request("q").seq_id
    assert unpack_ids(second.seq_ids) == [seq_p, seq_q]
    result = run_step(scheduler, second, 9)
    result.logprob_seq_ids = pack_ids([seq_q])
    result.logprobs = [record(0, start=0)]
    owners = extras.owners(result, scheduler.request_of_seq)
    outputs = extras.decorate(scheduler.on_step_result(result), result, owners)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["q"].logprobs is not None and by_id["q"].logprobs.start == 0
    assert by_id["p"].logprobs is None


def stats(running: int = 0, waiting: int = 0) -> EngineStats:
    return EngineStats(running, waiting, 0.0, 0, 0, 0, 0, 0, 0, 0.0)


def test_stats_are_published_on_change_at_most_every_tick_and_as_a_heartbeat():
    clock, sent = Clock(0.0), []
    publisher = StatsPublisher(sent.append, clock, min_interval=0.1, heartbeat=2.0)
    assert publisher.maybe_publish(stats())  # the first one at once
    clock.now = 0.05
    assert not publisher.maybe_publish(stats(running=1))  # changed, but too soon
    assert publisher.dirty and publisher.seconds_until_due() == 0.05
    clock.now = 0.1
    assert publisher.maybe_publish(stats(running=1))
    clock.now = 1.0
    assert not publisher.maybe_publish(stats(running=1))  # unchanged
    clock.now = 2.1
    assert publisher.maybe_publish(stats(running=1))  # heartbeat
    assert [s.num_running for s in sent] == [0, 1, 1]


def test_watchdog_fires_once_per_stalled_step():
    clock, alarms = Clock(0.0), []
    steps = StepClock(clock)
    watchdog = StepWatchdog(2.0, alarms.append)
    steps.sent(1)
    clock.now = 1.0
    steps.sent(2)
    assert not watchdog.check(steps.oldest())
    clock.now = 2.5
    assert watchdog.check(steps.oldest()) and alarms[0].step_id == 1
    assert not watchdog.check(steps.oldest())  # the same step: once
    steps.done(1)
    clock.now = 3.5
    assert watchdog.check(steps.oldest()) and alarms[1].step_id == 2
    assert not StepWatchdog(0.0, alarms.append).check((5, 100.0))  # off
