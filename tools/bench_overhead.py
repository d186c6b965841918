"""Engine overhead on the CPU: what the process pipeline costs per step and per token, beside
the model's own step time, and microbenchmarks of the hot host-side pieces.

    python -m tools.bench_overhead --out DIR     # makes a micro Qwen3 in a temp dir

1. Pipeline. For each batch B, the model's own decode step is measured in this process: an
   in-process Scheduler drives ``ModelRunner`` on the same shapes (B prompts of --input-len,
   --output-len tokens each), one step at a time, timing submit to result. That is the floor
   ("roofline") a served decode step can reach. The real process tree then serves the same
   B requests (streaming, ignore_eos), and the median inter-token latency gives its step
   time. The difference is the pipeline's overhead per step (frontend, tokenizer, scheduler,
   detokenizer, the ZeroMQ hops, HTTP streaming) not hidden behind the model's step; divided
   by B, per token. The two are alternated --repeats times and the best of each kept. On the
   CPU the scheduler runs on another core while the worker computes, so a negative overhead
   means the pipeline is fully hidden. The default model is ``micro`` (tiny Qwen3 with a
   4096-token vocabulary) so that the model's step is short beside the overhead.
2. Microbenchmarks: protocol encode/decode of a decode-step StepPlan and StepResult at
   batch 64 and 256, and Scheduler.schedule() + on_step_result() per decode step at batch 64
   and 256 (target 0.3 ms at batch 64), median of many iterations.

Everything runs on the CPU whatever the machine has, so that a regression in host code shows
without a GPU. Compare runs on the same machine: on a loaded machine the figures move.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from tools.bench_common import (
    parse_int_list,
    pct,
    print_table,
    progress,
    run_metadata,
    save_json,
    save_plot,
)

SCHEDULER_TARGET_MS = 0.3


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: a micro Qwen3 in a temp dir")
    p.add_argument("--batches", default="1,16,64", help="concurrent requests per measurement")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--micro-batches", default="64,256", help="batch sizes of the microbenchmarks")
    p.add_argument("--micro-iters", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3, help="alternated runs per batch; best kept")
    p.add_argument("--skip-pipeline", action="store_true", help="only the microbenchmarks")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP threads of the model, here and in the worker (0: torch's default); one "
        "keeps the model's step steady on a busy machine",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="overhead")
    return p


# ---------------------------------------------------------------------------------------------
# Microbenchmarks
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# The pipeline against the model's own step
# ---------------------------------------------------------------------------------------------


def prompt_vocab(model_path: str) -> tuple[int, int]:
    from pegainfer.config import read_model_info

    return (3, min(4096, read_model_info(model_path).vocab_size))


def make_model(args: argparse.Namespace, max_batch: int) -> tuple[Any, Any]:
    """A ModelRunner on the CPU for the pipeline's shapes, and its engine config."""
    from tools.bench_common import load_model_shape
    from tools.bench_throughput import make_inprocess_runner

    runner_args = argparse.Namespace(
        model_path=args.model_path,
        input_len=args.input_len,
        output_len=args.output_len,
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=0,
        enforce_eager=True,
        seed=args.seed,
    )
    return make_inprocess_runner(runner_args, max_batch, load_model_shape(args.model_path, 4))


def model_step(runner: Any, config: Any, prompts: list[list[int]], output_len: int) -> dict:
    """The model's own decode step on these prompts, one step at a time, no pipeline."""
    from tools.bench_throughput import run_inprocess_batch

    row = run_inprocess_batch(runner, config, prompts, output_len, "model ", in_flight=1)
    return {"step_ms": row["runner_step_ms"], "output_tok_s": row["output_tok_s"]}


def served_step(base_url: str, model: str, prompts: list[list[int]], output_len: int) -> dict:
    """The served decode step (median ITL) of these prompts sent concurrently."""
    from tools.bench_client import aggregate, run_load

    bar = progress(len(prompts), f"served batch {len(prompts)}", "req")
    try:
        results, wall = asyncio.run(
            run_load(
                base_url,
                model,
                prompts,
                [output_len] * len(prompts),
                concurrency=len(prompts),
                on_done=lambda _: bar.update(1),
            )
        )
    finally:
        bar.close()
    summary = aggregate(results, wall)
    if summary["failed"]:
        raise RuntimeError(f"batch {len(prompts)}: {summary['errors']}")
    return {
        "step_ms": summary["itl_ms"]["p50"],
        "output_tok_s": summary["output_throughput"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
    }


def pipeline_rows(args: argparse.Namespace, batches: list[int]) -> list[dict[str, Any]]:
    """Per batch, the model's step in this process and the served step, alternated
    ``--repeats`` times; each figure is its best repeat, the one least disturbed by whatever
    else the machine runs."""
    from tools.bench_client import random_token_prompts, served_model
    from tools.bench_launch import ServerProcess

    runner, config = make_model(args, max(batches))
    vocab = prompt_vocab(args.model_path)
    warm = random_token_prompts([8], vocab, 99)
    model_step(runner, config, warm, 2)
    server_args = [
        "--device", "cpu",
        "--dtype", "float32",
        "--max-num-seqs", str(max(batches)),
        "--max-model-len", str(args.input_len + args.output_len + 8),
        "--max-num-batched-tokens", str(max(8192, args.input_len)),
        "--no-prefix-cache",
    ]  # fmt: skip
    log = os.path.join(args.out, f"{args.name}-server.log")
    rows = []
    with ServerProcess(args.model_path, server_args, log_path=log) as server:
        server.wait_ready()
        model, _ = served_model(server.base_url)
        served_step(server.base_url, model, warm, 2)
        for i, batch in enumerate(batches):
            prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + i)
            alone, served = [], []
            for _ in range(args.repeats):
                alone.append(model_step(runner, config, prompts, args.output_len))
                served.append(served_step(server.base_url, model, prompts, args.output_len))
            best_alone = min(alone, key=lambda r: r["step_ms"])
            best_served = min(served, key=lambda r: r["step_ms"])
            model_ms, served_ms = best_alone["step_ms"], best_served["step_ms"]
            overhead_ms = served_ms - model_ms
            rows.append(
                {
                    "batch": batch,
                    "served_step_ms": served_ms,
                    "model_step_ms": model_ms,
                    "overhead_ms_per_step": overhead_ms,
                    "overhead_us_per_token": overhead_ms * 1e3 / batch,
                    "pct_of_roofline": pct(model_ms, served_ms),
                    "served_tok_s": best_served["output_tok_s"],
                    "model_tok_s": best_alone["output_tok_s"],
                    "served_ttft_p50_ms": best_served["ttft_p50_ms"],
                    "served_step_ms_repeats": [r["step_ms"] for r in served],
                    "model_step_ms_repeats": [r["step_ms"] for r in alone],
                }
            )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    batches = parse_int_list(args.batches)
    micro_batches = parse_int_list(args.micro_batches)
    os.makedirs(args.out, exist_ok=True)
    # CPU only, whatever the machine has: this measures the host code. Set before torch is
    # imported, here and (inherited) in the server's processes.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.torch_threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)

    tables = []
    micro = protocol_micro(micro_batches, args.micro_iters)
    sched = scheduler_micro(micro_batches, max(200, args.micro_iters // 4))
    rows = [
        [r["what"], r["batch"], r.get("bytes"), r["median_us"], r["mean_us"], None, None]
        for r in micro
    ]
    for r in sched:
        target = SCHEDULER_TARGET_MS * 1e3 if r["batch"] == 64 else None
        met = (r["median_us"] <= target) if target else None
        rows.append([r["what"], r["batch"], None, r["median_us"], r["mean_us"], target, met])
    tables.append(
        print_table(
            "host-side microbenchmarks (CPU, per call)",
            ["what", "batch", "bytes", "median us", "mean us", "target us", "met"],
            rows,
        )
    )
    for r in sched:
        print(
            f"  scheduler at batch {r['batch']}: schedule {r['schedule_us']:.1f} us + "
            f"on_step_result {r['on_step_result_us']:.1f} us"
        )

    pipeline: list[dict[str, Any]] = []
    if not args.skip_pipeline:
        with tempfile.TemporaryDirectory(prefix="pegainfer-micro-") as tmp:
            if args.model_path is None:
                from tools.make_tiny_checkpoint import make_checkpoint

                args.model_path = make_checkpoint(tmp, "qwen3", "micro", args.seed, "float32")
            pipeline = pipeline_rows(args, batches)
        tables.append(
            print_table(
                f"pipeline overhead on CPU: {args.input_len} in, {args.output_len} out, "
                "streaming; served step = median ITL; roofline = the model's own step in-process",
                [
                    "batch",
                    "served step ms",
                    "roofline (model step) ms",
                    "% of roofline",
                    "overhead ms/step",
                    "overhead us/token",
                    "served tok/s",
                    "model tok/s",
                ],
                [
                    [
                        r["batch"],
                        r["served_step_ms"],
                        r["model_step_ms"],
                        r["pct_of_roofline"],
                        r["overhead_ms_per_step"],
                        r["overhead_us_per_token"],
                        r["served_tok_s"],
                        r["model_tok_s"],
                    ]
                    for r in pipeline
                ],
            )
        )

    payload = {
        "benchmark": "overhead",
        "meta": run_metadata(argv),
        "args": vars(args),
        "microbenchmarks": micro + sched,
        "scheduler_target_us": SCHEDULER_TARGET_MS * 1e3,
        "pipeline": pipeline,
        "table": "\n".join(tables),
    }
    save_json(args.out, args.name, payload)

    def draw(axes: list) -> None:
        labels = [f"{r['what']}\nB={r['batch']}" for r in micro + sched]
        values = [r["median_us"] for r in micro + sched]
        axes[0].barh(range(len(values)), values)
        axes[0].set_yticks(range(len(values)), labels, fontsize="x-small")
        axes[0].axvline(SCHEDULER_TARGET_MS * 1e3, color="red", linestyle=":", label="0.3 ms")
        axes[0].set_xlabel("median us per call")
        axes[0].legend()
        if pipeline:
            b = [str(r["batch"]) for r in pipeline]
            axes[1].bar(b, [r["model_step_ms"] for r in pipeline], label="model step (roofline)")
            axes[1].bar(
                b,
                [r["overhead_ms_per_step"] for r in pipeline],
                bottom=[r["model_step_ms"] for r in pipeline],
                label="pipeline overhead",
            )
            axes[1].set_xlabel("batch")
            axes[1].set_ylabel("ms per decode step")
            axes[1].legend()

    save_plot(args.out, args.name, draw, "engine host overhead (CPU)", ncols=2)
    return payload


if __name__ == "__main__":
    main()
