"""pegainfer in one process: a ``Scheduler`` driving a ``ModelRunner`` with no sockets, HTTP or
detokenizer in between, for benchmarks that need exact per-step times.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from typing import Any

from tools.bench_client import clamp_vocab_range, random_token_prompts
from tools.bench_common import progress
from tools.bench_model import ModelShape


def batched_tokens(args: argparse.Namespace) -> int:
    # Large enough that a wave of prompts is prefilled in a few steps, so the batch is full
    # while most of its decode steps run.
    return args.max_num_batched_tokens or max(8192, args.input_len)


def make_inprocess_runner(
    args: argparse.Namespace, max_batch: int, shape: ModelShape
) -> tuple[Any, Any]:
    """A ModelRunner with exactly the KV blocks the sweep needs (no profile run), and the
    engine config a Scheduler for it needs."""
    from pegainfer.config import EngineConfig, finalize, read_model_info
    from worker_proc.model_runner import ModelRunner

    block_size = 16
    max_model_len = args.input_len + args.output_len + 8
    blocks = max_batch * (-(-max_model_len // block_size) + 1)
    config = EngineConfig(
        model_path=args.model_path,
        served_model_name="bench",
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max_batch,
        max_model_len=max_model_len,
        max_num_batched_tokens=batched_tokens(args),
        block_size=block_size,
        kv_cache_memory=blocks * block_size * shape.kv_bytes_per_token,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        model=read_model_info(args.model_path),
    )
    config = finalize(config)
    runner = ModelRunner(config, 0)
    config.num_kv_blocks = runner.num_kv_blocks
    return runner, config


def run_inprocess_batch(
    runner: Any,
    config: Any,
    prompts: list[list[int]],
    output_len: int,
    tag: str = "",
    in_flight: int = 2,
) -> dict[str, Any]:
    """Serve ``prompts`` to completion with a fresh Scheduler driving ``runner``, with up to
    ``in_flight`` steps submitted ahead (as the scheduler and worker processes do).

    ``step_ms``: the median gap between two results arriving, over consecutive steps that
    both decoded the full batch. ``runner_step_ms``: the median time from submitting such a
    step to its result (with one in flight: the runner's own cost of the step)."""
    from pegainfer.protocol import (
        SamplingParams,
        StepPlan,
        TokenizedRequest,
        pack_ids,
        unpack_ids,
    )
    from scheduler_proc.scheduler import Scheduler
    from tools.bench_common import synchronize

    batch = len(prompts)
    scheduler = Scheduler(config)
    sampling = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    now = time.time()
    for j, prompt in enumerate(prompts):
        request = TokenizedRequest(f"{tag}{batch}-{j}", pack_ids(prompt), sampling, now)
        rejected = scheduler.add_request(request)
        if rejected is not None:
            raise RuntimeError(f"request rejected: {rejected.message}")
    pending: deque[tuple[int, bool, float]] = deque()  # step id, full decode, submitted at
    intervals: list[float] = []
    runner_times: list[float] = []
    first_token_s: list[float] = []
    tokens = 0
    last_done, last_full = 0.0, False
    bar = progress(batch * output_len, f"{tag}batch {batch}", "tok")
    synchronize(runner.device)
    began = time.perf_counter()
    while scheduler.has_work() or pending:
        while len(pending) < in_flight and scheduler.has_work():
            plan = scheduler.schedule()
            if plan is None:
                break
            scheduled = unpack_ids(plan.num_scheduled)
            full = len(scheduled) == batch and all(n == 1 for n in scheduled)
            pending.append((plan.step_id, full, time.perf_counter()))
            runner.submit(plan)
        if not pending:
            raise RuntimeError("the scheduler has work but planned no step")
        for result in runner.poll_results(wait=in_flight == 1):
            done = time.perf_counter()
            step_id, full, submitted = pending.popleft()
            if result.step_id != step_id or result.error:
                raise RuntimeError(f"step {step_id}: got {result.step_id}, {result.error}")
            if full:
                runner_times.append(done - submitted)
                if last_full:
                    intervals.append(done - last_done)
            last_done, last_full = done, full
            for output in scheduler.on_step_result(result):
                if output.completion_tokens == 1 and output.new_token_ids:
                    first_token_s.append(done - began)
            sampled = len(result.token_ids) // 4
            tokens += sampled
            bar.update(sampled)
    wall = time.perf_counter() - began
    bar.close()
    # The runner must drop the finished sequences: the next batch reuses their ids.
    finished = pack_ids(scheduler.pending_finished_seq_ids)
    runner.execute(StepPlan(-1, [], b"", b"", b"", [], finished))
    ordered = sorted(intervals)

    def median_ms(values: list[float]) -> float | None:
        return statistics.median(values) * 1e3 if values else None

    return {
        "batch": batch,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "ttft_p50_ms": median_ms(first_token_s),
        "step_ms": median_ms(ordered),
        "step_p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3 if ordered else None,
        "runner_step_ms": median_ms(runner_times),
        "full_batch_decode_steps": len(runner_times),
        "in_flight": in_flight,
    }


def sweep_inprocess(
    args: argparse.Namespace, batches: list[int], shape: ModelShape
) -> list[dict[str, Any]]:
    runner, config = make_inprocess_runner(args, max(batches), shape)
    vocab = clamp_vocab_range(args.vocab_range, args.model_path)
    # Warm-up: lazy initialisation must not land in the first batch.
    in_flight = 1 if args.no_overlap else 2
    warm = random_token_prompts([16], vocab, 99)
    run_inprocess_batch(runner, config, warm, 2, "warm-up ", in_flight)
    rows = []
    for i, batch in enumerate(batches):
        prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + i)
        rows.append(run_inprocess_batch(runner, config, prompts, args.output_len, "", in_flight))
    return rows
