"""Microbenchmarks of the host-side hot path, on the CPU: protocol encode/decode of a decode
step's StepPlan and StepResult, and one Scheduler step (schedule + on_step_result).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

SCHEDULER_TARGET_MS = 0.3


def time_us(fn: Callable[[], Any], iters: int) -> dict[str, float]:
    """Median and mean microseconds of ``fn`` over ``iters`` calls (after a short warm-up)."""
    for _ in range(min(50, iters)):
        fn()
    samples = []
    for _ in range(iters):
        began = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - began) / 1e3)
    return {"median_us": statistics.median(samples), "mean_us": statistics.fmean(samples)}


def decode_plan(batch: int, step_id: int = 7, context: int = 300) -> Any:
    """A typical decode step: every sequence schedules one token; one in block_size (16)
    crosses into a new block and gets a block update; none finished."""
    from pegainfer.protocol import BlockTableUpdate, StepPlan, pack_ids

    rng = random.Random(batch)
    updates = [
        BlockTableUpdate(seq_id, pack_ids([rng.randrange(100_000)]))
        for seq_id in range(0, batch, 16)
    ]
    return StepPlan(
        step_id=step_id,
        new_seqs=[],
        seq_ids=pack_ids(range(batch)),
        num_computed=pack_ids([context + i % 50 for i in range(batch)]),
        num_scheduled=pack_ids([1] * batch),
        block_updates=updates,
        finished_seq_ids=b"",
    )


def protocol_micro(batches: list[int], iters: int) -> list[dict[str, Any]]:
    from pegainfer.protocol import StepPlan, StepResult, decode, encode, pack_ids

    rows = []
    for batch in batches:
        plan = decode_plan(batch)
        result = StepResult(7, pack_ids(range(batch)), pack_ids([1234] * batch))
        plan_bytes, result_bytes = encode(plan), encode(result)
        for label, fn, size in (
            ("encode StepPlan", lambda p=plan: encode(p), len(plan_bytes)),
            ("decode StepPlan", lambda b=plan_bytes: decode(b, (StepPlan,)), len(plan_bytes)),
            ("encode StepResult", lambda r=result: encode(r), len(result_bytes)),
            (
                "decode StepResult",
                lambda b=result_bytes: decode(b, (StepResult,)),
                len(result_bytes),
            ),
        ):
            rows.append({"what": label, "batch": batch, "bytes": size, **time_us(fn, iters)})
    return rows


def scheduler_config(batch: int, max_model_len: int) -> Any:
    from pegainfer.config import EngineConfig, ModelInfo, finalize

    model = ModelInfo(
        architecture="Qwen3ForCausalLM",
        vocab_size=4096,
        max_position_embeddings=max_model_len,
        eos_token_ids=[2],
        bos_token_id=None,
        num_hidden_layers=2,
        num_kv_heads=2,
        head_dim=32,
        hidden_size=64,
    )
    config = EngineConfig(
        model_path="(none)",
        served_model_name="bench",
        max_num_seqs=batch,
        max_model_len=max_model_len,
        max_num_batched_tokens=8192,
        block_size=16,
        num_kv_blocks=batch * (max_model_len // 16 + 2),
        model=model,
    )
    return finalize(config)


def _scheduler_step(scheduler: Any, known: dict[int, int]) -> tuple[float, float]:
    """One step planned and answered as a worker would (a sequence samples token 7 when its
    computed tokens reach the length it knows, ``known``); the microseconds of schedule()
    and of on_step_result()."""
    from pegainfer.protocol import StepResult, pack_ids, unpack_ids

    began = time.perf_counter_ns()
    plan = scheduler.schedule()
    planned = time.perf_counter_ns()
    if plan is None:
        raise RuntimeError("the scheduler planned no step")
    samplers = []
    for seq_id, computed, scheduled in zip(
        unpack_ids(plan.seq_ids), unpack_ids(plan.num_computed), unpack_ids(plan.num_scheduled)
    ):
        if computed + scheduled == known[seq_id]:
            samplers.append(seq_id)
            known[seq_id] += 1
    result = StepResult(plan.step_id, pack_ids(samplers), pack_ids([7] * len(samplers)))
    answered = time.perf_counter_ns()
    scheduler.on_step_result(result)
    return (planned - began) / 1e3, (time.perf_counter_ns() - answered) / 1e3


def scheduler_micro(batches: list[int], iters: int) -> list[dict[str, Any]]:
    """schedule() + on_step_result() per decode step of a full batch, as the scheduler process
    runs them (default config: prefix caching on)."""
    from pegainfer.protocol import SamplingParams, TokenizedRequest, pack_ids
    from scheduler_proc.scheduler import Scheduler

    rows = []
    prompt_len = 128
    for batch in batches:
        max_model_len = prompt_len + iters + 256
        scheduler = Scheduler(scheduler_config(batch, max_model_len))
        sampling = SamplingParams(max_tokens=iters + 128, temperature=0.0, ignore_eos=True)
        rng = random.Random(batch)
        for j in range(batch):
            prompt = [rng.randrange(3, 4096) for _ in range(prompt_len)]
            scheduler.add_request(TokenizedRequest(f"r{j}", pack_ids(prompt), sampling, 0.0))
        # Seq ids are given in arrival order from 0; each knows its prompt at first.
        known = dict.fromkeys(range(batch), prompt_len)
        for _ in range(20):  # the prefill steps, then a few decodes
            _scheduler_step(scheduler, known)
        if scheduler.num_running != batch:
            raise RuntimeError(f"{scheduler.num_running} of {batch} requests running")
        samples = [_scheduler_step(scheduler, known) for _ in range(iters)]
        schedule_us = statistics.median(s[0] for s in samples)
        result_us = statistics.median(s[1] for s in samples)
        total = statistics.median(s[0] + s[1] for s in samples)
        rows.append(
            {
                "what": "Scheduler.schedule + on_step_result",
                "batch": batch,
                "schedule_us": schedule_us,
                "on_step_result_us": result_us,
                "median_us": total,
                "mean_us": statistics.fmean(s[0] + s[1] for s in samples),
            }
        )
    return rows
