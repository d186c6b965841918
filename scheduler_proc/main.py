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
from pegainfer.config import EngineConfig
from pegainfer.process import child_args, init_child, report_ready
from pegainfer.protocol import (
    AbortRequests,
    StepResult,
    TokenizedRequest,
    TokenOutputs,
    encode,
)
from scheduler_proc.scheduler import Scheduler

logger = logging.getLogger("scheduler_proc")

NAME = "scheduler"
ACCEPTED = (TokenizedRequest, AbortRequests, StepResult)
STATS_INTERVAL_S = 10.0


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

    def run(self) -> None:
        while True:
            self.run_once()

    def run_once(self, idle_timeout_ms: int = int(STATS_INTERVAL_S * 1000)) -> None:
        if not self._ready_to_plan():
            # Nothing to plan until a message arrives: block instead of spinning.
            self.inbound.poll(idle_timeout_ms)
        for msg in ipc.drain(self.inbound, ACCEPTED, NAME):
            self.handle(msg)
        self._plan()
        self._maybe_log_stats()

    def handle(self, msg: object) -> None:
        self._may_plan = True
        if isinstance(msg, StepResult):
            if msg.error is not None:
                raise WorkerFailed(f"step {msg.step_id} failed on the worker: {msg.error}")
            outputs = self.scheduler.on_step_result(msg)
        elif isinstance(msg, TokenizedRequest):
            rejection = self.scheduler.add_request(msg)
            if rejection is not None:
                ipc.send(self.frontend, rejection)
            return
        elif isinstance(msg, AbortRequests):
            outputs = self.scheduler.abort(msg.request_ids)
        else:
            logger.warning("ignored an unexpected %s", type(msg).__name__)
            return
        if outputs:
            ipc.send(self.detokenizer, TokenOutputs(outputs=outputs))

    def _ready_to_plan(self) -> bool:
        return (
            self._may_plan
            and self.scheduler.has_work()
            and self.scheduler.num_steps_in_flight < self.max_steps_in_flight
        )

    def _plan(self) -> None:
        while self._ready_to_plan():
            plan = self.scheduler.schedule()
            if plan is None:
                self._may_plan = False
                if self.scheduler.num_steps_in_flight == 0:
                    logger.warning(
                        "%d running and %d waiting requests, but none can be planned",
                        self.scheduler.num_running,
                        self.scheduler.num_waiting,
                    )
                return
            data = encode(plan)  # encoded once, the same bytes to every rank
            for worker in self.workers:
                worker.send(data, copy=False)

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
    """One until the workers feed sampled tokens forward on the GPU; then two."""
    value = config.extra.get("max_steps_in_flight", 1)
    return value if isinstance(value, int) and value >= 1 else 1


def main() -> None:
    args = child_args("pegainfer scheduler")
    config = init_child(NAME, args.run_dir)
    try:
        scheduler = Scheduler(config)
    except ValueError as exc:
        logger.error("cannot start: %s", exc)
        sys.exit(1)
    ctx = zmq.Context()
    inbound = ipc.bind(ctx, zmq.PULL, args.run_dir, "scheduler")
    workers = [
        ipc.connect(ctx, zmq.PUSH, args.run_dir, f"worker-{rank}")
        for rank in range(config.tensor_parallel_size)
    ]
    detokenizer = ipc.connect(ctx, zmq.PUSH, args.run_dir, "detokenizer")
    frontend = ipc.connect(ctx, zmq.PUSH, args.run_dir, "frontend")
    loop = SchedulerLoop(
        scheduler, inbound, workers, detokenizer, frontend, max_steps_in_flight(config)
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
    try:
        loop.run()
    except WorkerFailed as exc:
        logger.error("%s; exiting", exc)
        sys.exit(1)
