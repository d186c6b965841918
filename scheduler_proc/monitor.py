"""What the scheduler reports about itself: stats for the frontend's /metrics and admission
limit, and a watchdog on steps that take too long."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pegainfer.protocol import EngineStats, WatchdogAlarm
from scheduler_proc.stats import SchedulerStats

logger = logging.getLogger(__name__)

# Stats go out at most this often while they change, so /metrics is fresh within a tick...
STATS_MIN_INTERVAL_S = 0.1
# ...and at least this often while nothing changes, so the frontend can tell it is current.
STATS_HEARTBEAT_S = 2.0


def engine_stats(stats: SchedulerStats, oldest_step_age: float) -> EngineStats:
    return EngineStats(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_cache_usage=float(stats.kv_cache_usage),
        num_preemptions=stats.num_preemptions,
        prompt_tokens_total=stats.prompt_tokens_total,
        generation_tokens_total=stats.generation_tokens_total,
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        num_steps_in_flight=stats.num_steps_in_flight,
        oldest_step_age=oldest_step_age,
    )


class StepClock:
    """When each step in flight was sent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[int, float] = {}

    def sent(self, step_id: int) -> None:
        self._sent[step_id] = self._clock()

    def done(self, step_id: int) -> None:
        self._sent.pop(step_id, None)

    def oldest(self) -> tuple[int, float] | None:
        """(step id, seconds in flight) of the oldest step, or None."""
        if not self._sent:
            return None
        step_id = min(self._sent, key=self._sent.__getitem__)
        return step_id, self._clock() - self._sent[step_id]


class StatsPublisher:
    """Sends EngineStats when they changed (at most every STATS_MIN_INTERVAL_S), and a
    heartbeat otherwise."""

    def __init__(
        self,
        send: Callable[[EngineStats], None],
        clock: Callable[[], float] = time.monotonic,
        min_interval: float = STATS_MIN_INTERVAL_S,
        heartbeat: float = STATS_HEARTBEAT_S,
    ) -> None:
        self._send = send
        self._clock = clock
        self.min_interval = min_interval
        self.heartbeat = heartbeat
        self._last_sent = float("-inf")
        self._last_key: tuple | None = None
        self.dirty = False  # something changed since the last publication

    def maybe_publish(self, stats: EngineStats) -> bool:
        now = self._clock()
        key = _change_key(stats)
        if key != self._last_key:
            self.dirty = True
        since = now - self._last_sent
        if (self.dirty and since >= self.min_interval) or since >= self.heartbeat:
            try:
                self._send(stats)
            except Exception:  # noqa: BLE001 - metrics must never stop the scheduler
                logger.exception("could not publish stats")
            self._last_sent = now
            self._last_key = key
            self.dirty = False
            return True
        return False

    def seconds_until_due(self) -> float:
        """How long the loop may sleep before a publication is due."""
        interval = self.min_interval if self.dirty else self.heartbeat
        return max(0.0, self._last_sent + interval - self._clock())


def _change_key(stats: EngineStats) -> tuple:
    # The step age changes every instant; it is not a change worth a message.
    return (
        stats.num_running,
        stats.num_waiting,
        round(stats.kv_cache_usage, 4),
        stats.num_preemptions,
        stats.prompt_tokens_total,
        stats.generation_tokens_total,
        stats.prefix_cache_queries,
        stats.prefix_cache_hits,
        stats.num_steps_in_flight,
    )


class StepWatchdog:
    """Raises the alarm, once per stalled step, when a step is in flight too long."""

    def __init__(
        self, timeout: float, alarm: Callable[[WatchdogAlarm], None], name: str = "scheduler"
    ) -> None:
        self.timeout = timeout
        self._alarm = alarm
        self._name = name
        self._alarmed: int | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout > 0

    def check(self, oldest: tuple[int, float] | None) -> bool:
        if not self.enabled or oldest is None:
            return False
        step_id, age = oldest
        if age < self.timeout or self._alarmed == step_id:
            return False
        self._alarmed = step_id
        logger.error(
            "watchdog: step %d has been in flight for %.1f s (limit %.1f s); "
            "asking the launcher to dump every process's stack and stop",
            step_id,
            age,
            self.timeout,
        )
        try:
            self._alarm(WatchdogAlarm(name=self._name, step_id=step_id, seconds=age))
        except Exception:  # noqa: BLE001
            logger.exception("could not raise the watchdog alarm")
        return True
