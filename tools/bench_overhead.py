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
2. Microbenchmarks, median of many iterations, at batch 64 and 256: protocol encode/decode
   of a decode step's StepPlan, StepResult and TokenOutputs; Scheduler.schedule() +
   on_step_result() per decode step; and the worker's host-side preparation of the step
   (plan diffs, layout, upload arrays; the model is not run). The target, 0.3 ms at batch
   64, counts the scheduler's step plus encode and decode of the plan and of the result;
   the summary beside it adds the worker's preparation and the encode of the new tokens,
   the whole host time of a step.

Everything runs on the CPU whatever the machine has, so that a regression in host code shows
without a GPU. Compare runs on the same machine: on a loaded machine the figures move.
"""

from __future__ import annotations

import argparse
import os
import tempfile
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
from tools.bench_host_micro import (
    SCHEDULER_TARGET_MS,
    host_step_summary,
    protocol_micro,
    scheduler_micro,
    worker_micro,
)


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
# The pipeline against the model's own step
# ---------------------------------------------------------------------------------------------


def prompt_vocab(model_path: str) -> tuple[int, int]:
    from pegainfer.config import read_model_info

    return (3, min(4096, read_model_info(model_path).vocab_size))


def make_model(args: argparse.Namespace, max_batch: int) -> tuple[Any, Any]:
    """A ModelRunner on the CPU for the pipeline's shapes, and its engine config."""
    from tools.bench_inprocess import make_inprocess_runner
    from tools.bench_model import load_model_shape

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
    from tools.bench_inprocess import run_inprocess_batch

    row = run_inprocess_batch(runner, config, prompts, output_len, "model ", in_flight=1)
    return {"step_ms": row["runner_step_ms"], "output_tok_s": row["output_tok_s"]}


def served_step(base_url: str, model: str, prompts: list[list[int]], output_len: int) -> dict:
    """The served decode step (median ITL) of these prompts sent concurrently."""
    from tools.bench_client import aggregate, run_async, run_load

    bar = progress(len(prompts), f"served batch {len(prompts)}", "req")
    try:
        results, wall = run_async(
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


def print_host_step(batch: int, summary: dict[str, float], target_us: float | None) -> None:
    """The host time of one decode step, part by part, beside the target."""
    verdict = ""
    if target_us is not None:
        met = summary["target_measure_us"] <= target_us
        verdict = f"  (target {target_us:.0f} us: {'met' if met else 'NOT met'})"
    lines = [
        ("scheduler: schedule + on_step_result", summary["scheduler_us"]),
        ("StepPlan encode + decode", summary["plan_codec_us"]),
        ("StepResult encode + decode", summary["result_codec_us"]),
        ("= what the target counts", summary["target_measure_us"]),
        ("worker: apply_diffs + layout + upload", summary["worker_prep_us"]),
        ("scheduler: TokenOutputs encode", summary["outputs_encode_us"]),
        ("= full host time of the step", summary["full_host_us"]),
    ]
    print(f"\nhost time per decode step at batch {batch}{verdict}")
    for label, value in lines:
        print(f"  {label:<40} {value:8.1f} us")


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
    worker = worker_micro(micro_batches, max(200, args.micro_iters // 4))
    target_us = SCHEDULER_TARGET_MS * 1e3
    rows = [
        [r["what"], r["batch"], r.get("bytes"), r["median_us"], r["mean_us"], None, None]
        for r in micro
    ]
    for r in sched + worker:
        target = target_us if r["batch"] == 64 else None
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
    host_steps = {}
    for batch in micro_batches:
        summary = host_step_summary(micro + sched + worker, batch)
        if summary is not None:
            host_steps[batch] = summary
            print_host_step(batch, summary, target_us if batch == 64 else None)

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
        "microbenchmarks": micro + sched + worker,
        "scheduler_target_us": target_us,
        "host_step_us": host_steps,
        "pipeline": pipeline,
        "table": "\n".join(tables),
    }
    save_json(args.out, args.name, payload)

    def draw(axes: list) -> None:
        labels = [f"{r['what']}\nB={r['batch']}" for r in micro + sched + worker]
        values = [r["median_us"] for r in micro + sched + worker]
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
