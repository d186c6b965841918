"""The scheduler process: `python -m scheduler_proc --run-dir DIR`.

Receives tokenized requests, aborts and step results on its PULL socket, plans steps for
every worker rank, and passes each step's new tokens to the detokenizer as one message.
"""

from __future__ import annotations

import logging
import sys
import time

import zmq

from pegainfer import ipc
from pegainfer.config import STAGE_WORKERS_READY, EngineConfig
from pegainfer.multinode import scheduler_plan_socket
from pegainfer.process import child_args, init_child, report_ready
from pegainfer.protocol import (
    AbortRequests,
    PrefixCacheReset,
    ResetPrefixCache,
    StepResult,
    TokenizedRequest,
    TokenOutputs,
    encode,
)
from scheduler_proc.grammar_install import missing_requirements
from scheduler_proc.monitor import StatsPublisher, StepClock, StepWatchdog, engine_stats
from scheduler_proc.output_extras import OutputExtras
from scheduler_proc.scheduler import Scheduler

logger = logging.getLogger("scheduler_proc")

NAME = "scheduler"
ACCEPTED = (TokenizedRequest, AbortRequests, StepResult, ResetPrefixCache)
STATS_INTERVAL_S = 10.0
# While a grammar compiles, wake this often to move its request on once it is ready.
COMPILE_POLL_MS = 2
DEFAULT_WATCHDOG_TIMEOUT_S = 300.0


class WorkerFailed(RuntimeError):
    """A worker reported an error for a step; the engine cannot go on."""


class SchedulerLoop:
    """Owns the sockets around a ``Scheduler``; one iteration of ``run`` is ``run_once``."""

    def __init__(
        self,
        scheduler: Scheduler,
        inbound: zmq.Socket,
        workers: list[zmq.Socket],
        detokenizer: zmq.Socket,
        frontend: zmq.Socket,
        max_steps_in_flight: int = 1,
        launcher: zmq.Socket | None = None,
        watchdog_timeout: float = 0.0,
    ) -> None:
        self.scheduler = scheduler
        self.inbound = inbound
        self.workers = workers
        self.detokenizer = detokenizer
        self.frontend = frontend
        self.max_steps_in_flight = max(1, max_steps_in_flight)
        # False once schedule() found nothing to do; only a new message can change that.
        self._may_plan = True
        self._last_stats = time.monotonic()
        self._last_generated = 0
        self._last_prompt = 0
        self.extras = OutputExtras()
        self.step_clock = StepClock()
        self.publisher = StatsPublisher(lambda stats: ipc.send(frontend, stats))
        self.watchdog = StepWatchdog(
            watchdog_timeout if launcher is not None else 0.0,
            lambda alarm: ipc.send(launcher, alarm),
        )

    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self, idle_timeout_ms: int = int(STATS_INTERVAL_S * 1000)) -> None:
        if not self._ready_to_plan():
            # Nothing to plan until a message arrives: block instead of spinning, but wake
            # for the stats that are due and for the watchdog.
            wake_ms = int(self.publisher.seconds_until_due() * 1000) + 1
            if self.step_clock.oldest() is not None and self.watchdog.enabled:
                wake_ms = min(wake_ms, 500)
            if self.scheduler.num_compiling:
                wake_ms = COMPILE_POLL_MS
            self.inbound.poll(min(idle_timeout_ms, wake_ms))
        for msg in ipc.drain(self.inbound, ACCEPTED, NAME):
            self.handle(msg)
        if self.scheduler.num_compiling:
            self._collect_grammars()
        self._plan()
        self._maybe_log_stats()
        oldest = self.step_clock.oldest()
        self.publisher.maybe_publish(
            engine_stats(self.scheduler.stats(), oldest[1] if oldest else 0.0)
        )
        self.watchdog.check(oldest)

    def handle(self, msg: object) -> None:
        self._may_plan = True
        if isinstance(msg, StepResult):
            if msg.error is not None:
                raise WorkerFailed(f"step {msg.step_id} failed on the worker: {msg.error}")
            self.step_clock.done(msg.step_id)
            owners = self.extras.owners(msg, self.scheduler.request_of_seq)
            outputs = self.scheduler.apply_step_result(msg)
            # First the masks a queued step's draw waits for: the GPU may be waiting too.
            for masks in self.scheduler.take_step_masks():
                ipc.send(self.workers[0], masks)
            outputs = self.extras.decorate(outputs, msg, owners)
        elif isinstance(msg, TokenizedRequest):
            rejection = self.scheduler.add_request(msg)
            if rejection is not None:
                ipc.send(self.frontend, rejection)
            elif self.scheduler.get_request(msg.request_id) is not None:
                self.extras.on_admitted(msg.request_id, msg.sampling)
            return
        elif isinstance(msg, AbortRequests):
            outputs = self.extras.decorate(self.scheduler.apply_aborts(msg.request_ids))
        elif isinstance(msg, ResetPrefixCache):
            reset = self.scheduler.reset_prefix_cache()
            entries, freed = reset or (0, 0)
            ipc.send(
                self.frontend, PrefixCacheReset(msg.request_id, reset is not None, entries, freed)
            )
            return
        else:
            logger.warning("ignored an unexpected %s", type(msg).__name__)
            return
        if outputs:
            ipc.send(self.detokenizer, TokenOutputs(outputs=outputs))
        # Only now, with the tokens on their way: free finished requests' blocks, log them.
        self.scheduler.run_deferred()

    def _collect_grammars(self) -> None:
        waiting = self.scheduler.num_waiting
        for rejection in self.scheduler.collect_grammars():
            self.extras.forget(rejection.request_id)
            ipc.send(self.frontend, rejection)
        if self.scheduler.num_waiting != waiting:
            self._may_plan = True

    def _ready_to_plan(self) -> bool:
        in_flight = self.scheduler.num_steps_in_flight
        return (
            self._may_plan
            and self.scheduler.has_work()
            and in_flight < self.max_steps_in_flight
            # A plan may not overtake the masks of one before it (scheduler_proc/structured.py).
            and not self.scheduler.constrained.deferred
        )

    def _plan(self) -> None:
        while self._ready_to_plan():
            plan = self.scheduler.schedule()
            if plan is None:
                self._may_plan = False
                if self.scheduler.num_steps_in_flight == 0 and (
                    self.scheduler.num_running or self.scheduler.num_waiting
                ):
                    logger.warning(
                        "%d running and %d waiting requests, but none can be planned",
                        self.scheduler.num_running,
                        self.scheduler.num_waiting,
                    )
                return
            data = encode(plan)  # encoded once, the same bytes to every rank
            self.step_clock.sent(plan.step_id)
            for worker in self.workers:
                worker.send(data, copy=False)
            # While the workers run the step: the tap's copies, and what the plan did not need.
            for worker in self.workers:
                ipc.mirror(worker, data)
            if plan.new_seqs:
                self.extras.on_planned(
                    [
                        request
                        for new in plan.new_seqs
                        if (request := self.scheduler.request_of_seq(new.seq_id)) is not None
                    ]
                )
            self.scheduler.run_deferred()  # index its blocks in the prefix cache, log

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_stats
        if elapsed < STATS_INTERVAL_S:
            return
        stats = self.scheduler.stats()
        generated = stats.generation_tokens_total - self._last_generated
        prompted = stats.prompt_tokens_total - self._last_prompt
        if generated or prompted or stats.num_running or stats.num_waiting:
            logger.info(
                "running %d, waiting %d, KV cache %.1f%%, preemptions %d, "
                "prompt %.1f tok/s, generation %.1f tok/s",
                stats.num_running,
                stats.num_waiting,
                100.0 * stats.kv_cache_usage,
                stats.num_preemptions,
                prompted / elapsed,
                generated / elapsed,
            )
        self._last_stats = now
        self._last_generated = stats.generation_tokens_total
        self._last_prompt = stats.prompt_tokens_total


def max_steps_in_flight(config: EngineConfig) -> int:
    """Two: the workers feed sampled tokens forward on the device, so the next plan can be
    in flight while a step's result travels back. One with ``--no-overlap``.
    ``config.extra["max_steps_in_flight"]`` overrides both."""
    value = config.extra.get("max_steps_in_flight")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return 1 if config.no_overlap else 2


def watchdog_timeout(config: EngineConfig) -> float:
    value = config.extra.get("watchdog_timeout", DEFAULT_WATCHDOG_TIMEOUT_S)
    return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0


def main() -> None:
    args = child_args("pegainfer scheduler")
    config = init_child(NAME, args.run_dir, STAGE_WORKERS_READY)
    try:
        scheduler = Scheduler(config)
    except ValueError as exc:
        logger.error("cannot start: %s", exc)
        sys.exit(1)
    ctx = zmq.Context()
    inbound = ipc.bind(ctx, zmq.PULL, args.run_dir, "scheduler")
    # Ranks on other nodes get their plans over TCP (pegainfer/multinode.py).
    workers = [
        scheduler_plan_socket(ctx, config, rank) for rank in range(config.tensor_parallel_size)
    ]
    detokenizer = ipc.connect(ctx, zmq.PUSH, args.run_dir, "detokenizer")
    frontend = ipc.connect(ctx, zmq.PUSH, args.run_dir, "frontend")
    launcher = ipc.connect(ctx, zmq.PUSH, args.run_dir, "launcher")
    loop = SchedulerLoop(
        scheduler,
        inbound,
        workers,
        detokenizer,
        frontend,
        max_steps_in_flight(config),
        launcher=launcher,
        watchdog_timeout=watchdog_timeout(config),
    )
    report_ready(
        ctx,
        args.run_dir,
        NAME,
        num_kv_blocks=config.num_kv_blocks,
        max_steps_in_flight=loop.max_steps_in_flight,
    )
    logger.info(
        "ready: %d KV blocks of %d tokens, max %d sequences, %d tokens per step",
        config.num_kv_blocks,
        config.block_size,
        config.max_num_seqs,
        config.max_num_batched_tokens,
    )
    if missing := missing_requirements():
        logger.warning(
            "structured output will be unavailable: %s not installed (xgrammar and its "
            "dependencies); constrained requests will get a 400",
            ", ".join(missing),
        )
    try:
        loop.run()
    except WorkerFailed as exc:
        logger.error("%s; exiting", exc)
        sys.exit(1)
