"""pegainfer in one process: a ``Scheduler`` driving a ``ModelRunner`` with no sockets, HTTP or
detokenizer in between, for benchmarks that need exact per-step times.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from tools.bench_client import clamp_vocab_range, random_token_prompts
from tools.bench_common import progress
from tools.bench_model import ModelShape

PROFILE_WARM_STEPS = 4


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
    # A profiled batch decodes a few warm-up steps, the profiled ones and the two in flight,
    # and its first sequences may decode while the last prompts are prefilled.
    prefill_steps = -(-max_batch * args.input_len // batched_tokens(args))
    profiled = PROFILE_WARM_STEPS + getattr(args, "profile_steps", 0) + 4 + prefill_steps
    max_model_len = args.input_len + max(args.output_len, profiled) + 8
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


class StepDriver:
    """Feeds a fresh ``Scheduler``'s plans for ``requests`` to ``runner``, up to ``in_flight``
    steps ahead (as the scheduler and worker processes do), and its results back."""

    def __init__(self, runner: Any, config: Any, requests: list[Any], in_flight: int) -> None:
        from scheduler_proc.scheduler import Scheduler

        self.runner = runner
        self.scheduler = Scheduler(config)
        self.in_flight = in_flight
        self.batch = len(requests)
        # step id, whether it decodes the full batch, when it was submitted
        self.pending: deque[tuple[int, bool, float]] = deque()
        for request in requests:
            rejected = self.scheduler.add_request(request)
            if rejected is not None:
                raise RuntimeError(f"request rejected: {rejected.message}")

    def busy(self) -> bool:
        return self.scheduler.has_work() or bool(self.pending)

    def fill(self, limit: int | None = None) -> list[tuple[bool, list[int]]]:
        """Submit plans until ``in_flight`` are pending (at most ``limit`` of them); for each,
        whether it decodes the full batch, and its sequences' computed tokens."""
        from pegainfer.protocol import unpack_ids

        submitted: list[tuple[bool, list[int]]] = []
        while len(self.pending) < self.in_flight and self.scheduler.has_work():
            if limit is not None and len(submitted) >= limit:
                break
            plan = self.scheduler.schedule()
            if plan is None:
                break
            scheduled = unpack_ids(plan.num_scheduled)
            full = len(scheduled) == self.batch and all(n == 1 for n in scheduled)
            self.pending.append((plan.step_id, full, time.perf_counter()))
            self.runner.submit(plan)
            submitted.append((full, unpack_ids(plan.num_computed)))
        if not self.pending and self.scheduler.has_work():
            raise RuntimeError("the scheduler has work but planned no step")
        return submitted

    def collect(self, wait: bool = False) -> list[tuple[Any, bool, float, list[Any]]]:
        """Finished steps: (result, full batch, seconds from submission, request outputs)."""
        finished = []
        for result in self.runner.poll_results(wait=wait or self.in_flight == 1):
            done = time.perf_counter()
            step_id, full, submitted = self.pending.popleft()
            if result.step_id != step_id or result.error:
                raise RuntimeError(f"step {step_id}: got {result.step_id}, {result.error}")
            outputs = self.scheduler.on_step_result(result)
            finished.append((result, full, done - submitted, outputs))
        return finished

    def release(self) -> None:
        """The runner must drop the finished sequences: the next batch reuses their ids."""
        from pegainfer.protocol import StepPlan, pack_ids

        finished = pack_ids(self.scheduler.pending_finished_seq_ids)
        self.runner.execute(StepPlan(-1, [], b"", b"", b"", [], finished))


def make_requests(
    prompts: list[list[int]], max_tokens: int, tag: str, sampling: Sequence[dict[str, Any]] = ()
) -> list[Any]:
    """Requests of ``max_tokens`` each, ``ignore_eos``; request ``j`` takes the fields of
    ``sampling[j % len(sampling)]`` (none: greedy)."""
    from pegainfer.protocol import SamplingParams, TokenizedRequest, pack_ids

    settings = list(sampling) or [{"temperature": 0.0}]
    now = time.time()
    return [
        TokenizedRequest(
            f"{tag}{len(prompts)}-{j}",
            pack_ids(prompt),
            SamplingParams(
                **{"temperature": 0.0, **settings[j % len(settings)]},
                max_tokens=max_tokens,
                ignore_eos=True,
            ),
            now,
        )
        for j, prompt in enumerate(prompts)
    ]


def run_inprocess_batch(
    runner: Any,
    config: Any,
    prompts: list[list[int]],
    output_len: int,
    tag: str = "",
    in_flight: int = 2,
    sampling: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Serve ``prompts`` to completion with a fresh Scheduler driving ``runner``, with up to
    ``in_flight`` steps submitted ahead.

    ``step_ms``: the median gap between two results arriving, over consecutive steps that
    both decoded the full batch. ``runner_step_ms``: the median time from submitting such a
    step to its result (with one in flight: the runner's own cost of the step)."""
    from tools.bench_common import synchronize

    batch = len(prompts)
    requests = make_requests(prompts, output_len, tag, sampling)
    driver = StepDriver(runner, config, requests, in_flight)
    intervals: list[float] = []
    runner_times: list[float] = []
    first_token_s: list[float] = []
    tokens = 0
    last_done, last_full = 0.0, False
    bar = progress(batch * output_len, f"{tag}batch {batch}", "tok")
    synchronize(runner.device)
    began = time.perf_counter()
    while driver.busy():
        driver.fill()
        for result, full, took, outputs in driver.collect():
            done = time.perf_counter()
            if full:
                runner_times.append(took)
                if last_full:
                    intervals.append(done - last_done)
            last_done, last_full = done, full
            for output in outputs:
                if output.completion_tokens == 1 and output.new_token_ids:
                    first_token_s.append(done - began)
            sampled = len(result.token_ids) // 4
            tokens += sampled
            bar.update(sampled)
    wall = time.perf_counter() - began
    bar.close()
    driver.release()
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


def profile_full_decode(
    runner: Any,
    config: Any,
    prompts: list[list[int]],
    steps: int,
    in_flight: int = 2,
    warm_steps: int = PROFILE_WARM_STEPS,
) -> tuple[Any, list[int]]:
    """Prefill ``prompts``, decode ``warm_steps`` full-batch steps, then profile exactly
    ``steps`` more with the torch profiler, nothing else on the device in the window; the
    requests are then aborted. Returns the finished profiler and the contexts the window's
    first step attends to."""
    from torch.profiler import ProfilerActivity, profile

    from tools.bench_common import synchronize

    # As many tokens as the model length allows: sequences that began to decode while later
    # prompts were prefilled run ahead of the rest, and none may finish inside the window.
    output_len = config.max_model_len - max(len(p) for p in prompts)
    if output_len < warm_steps + steps + in_flight:
        raise ValueError(f"max_model_len {config.max_model_len} leaves too few decode steps")
    requests = make_requests(prompts, output_len, "profile ")
    driver = StepDriver(runner, config, requests, in_flight)
    full_done = 0
    while full_done < warm_steps:
        if not driver.busy():
            raise RuntimeError("the batch finished before it decoded as a whole")
        driver.fill()
        full_done += sum(full for _, full, _, _ in driver.collect())
    driver.collect(wait=True)
    synchronize(runner.device)
    contexts: list[int] = []
    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # The profiler's events are tracked objects by the hundred thousand: with the collector
    # on, full collections walking them (80-380 ms each on an H200 host) fall inside the
    # profiled steps, as in bench_latency.
    gc.disable()
    try:
        with profile(activities=activities) as prof:
            submitted = 0
            while submitted < steps or driver.pending:
                for full, computed in driver.fill(limit=steps - submitted):
                    if not full:
                        raise RuntimeError("a profiled step was not a decode of the full batch")
                    contexts = contexts or [c + 1 for c in computed]
                    submitted += 1
                driver.collect()
            synchronize(runner.device)
    finally:
        gc.enable()
    driver.scheduler.abort([r.request_id for r in requests])
    driver.release()
    return prof, contexts


def profile_prefill(
    runner: Any, config: Any, prompts: list[list[int]], in_flight: int = 2
) -> tuple[Any, int]:
    """Serve ``prompts`` asking one token each, so that every step prefills, with the torch
    profiler on from the first step to the last result. Returns the profiler and the steps."""
    from torch.profiler import ProfilerActivity, profile

    from tools.bench_common import synchronize

    driver = StepDriver(runner, config, make_requests(prompts, 1, "prefill "), in_flight)
    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 0
    synchronize(runner.device)
    gc.disable()  # as in profile_full_decode
    try:
        with profile(activities=activities) as prof:
            while driver.busy():
                for full, _ in driver.fill():
                    if full:
                        raise RuntimeError("a profiled prefill step decoded the whole batch")
                    steps += 1
                driver.collect()
            synchronize(runner.device)
    finally:
        gc.enable()
    driver.release()
    return prof, steps


def sweep_inprocess(
    args: argparse.Namespace, batches: list[int], shape: ModelShape, roof: Any = None
) -> list[dict[str, Any]]:
    """One row per batch; then, for each batch of ``args.profile_batches``, a profile of
    ``args.profile_steps`` full-batch decode steps, put in that batch's row; with
    ``args.profile_prefill``, a profile of the largest batch's prefill, put in its row."""
    from tools.step_profile import summarize_profile

    profile_batches = getattr(args, "profile_batches", [])
    from kernels.compile_watch import watch_late_compiles
    from pegainfer.gc_control import settle_heap

    runner, config = make_inprocess_runner(args, max(batches), shape)
    settle_heap("bench")  # as the worker does once it is ready
    watch = watch_late_compiles("bench")
    vocab = clamp_vocab_range(args.vocab_range, args.model_path)
    # Warm-up: lazy initialisation must not land in the first batch.
    in_flight = 1 if args.no_overlap else 2
    warm = random_token_prompts([16], vocab, 99)
    run_inprocess_batch(runner, config, warm, 2, "warm-up ", in_flight)
    sampling = getattr(args, "sampling_settings", ())
    rows = []
    for i, batch in enumerate(batches):
        prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + i)
        rows.append(
            run_inprocess_batch(runner, config, prompts, args.output_len, "", in_flight, sampling)
        )
    if watch is not None:
        print(watch.summary(), flush=True)
    for batch in profile_batches:
        prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + batch)
        prof, contexts = profile_full_decode(runner, config, prompts, args.profile_steps, in_flight)
        row = next(r for r in rows if r["batch"] == batch)
        title = (
            f"where a decode step's GPU time goes: batch {batch}, contexts "
            f"{min(contexts)}-{max(contexts)}, {args.profile_steps} steps, {in_flight} in flight"
        )
        if runner.device.type == "cuda":
            result, text = summarize_profile(prof, args.profile_steps, shape, roof, contexts, title)
            row["profile"] = result
        else:  # no device kernels: the host ops are all there is to show
            text = title + " (host ops; kernels need CUDA)\n"
            text += prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        row["profile_table"] = text
    if getattr(args, "profile_prefill", False):
        largest = max(rows, key=lambda r: r["batch"])
        largest.update(_prefill_profile_row(args, runner, config, largest["batch"], shape, roof))
    return rows


def _prefill_profile_row(
    args: argparse.Namespace, runner: Any, config: Any, batch: int, shape: ModelShape, roof: Any
) -> dict[str, Any]:
    """The prefill profile of ``batch`` fresh prompts, for that batch's row."""
    from tools.prefill_profile import summarize_prefill

    vocab = clamp_vocab_range(args.vocab_range, args.model_path)
    prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + 7 * batch)
    in_flight = 1 if args.no_overlap else 2
    prof, steps = profile_prefill(runner, config, prompts, in_flight)
    title = (
        f"where a prefill step's GPU time goes: {batch} prompts of {args.input_len} tokens in "
        f"{steps} steps of up to {config.max_num_batched_tokens} tokens, {in_flight} in flight"
    )
    if runner.device.type != "cuda":
        text = title + " (host ops; kernels need CUDA)\n"
        text += prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        return {"prefill_profile_table": text}
    result, text = summarize_prefill(prof, steps, shape, roof, [len(p) for p in prompts], title)
    return {"prefill_profile": result, "prefill_profile_table": text}
