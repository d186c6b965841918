"""Batch-1 decode latency: tok/s and ms per step at several context lengths, beside the
roofline measured in the same run.

    python -m tools.bench_latency --model-path DIR --contexts 128,4096 --steps 256 --out DIR

It drives ``worker_proc.model_runner.ModelRunner`` directly with step plans, as the scheduler
would: prefill the context (in chunks of max_num_batched_tokens; ``--prefill-repeats`` times,
the median reported as the prefill's time), then run warm-up and timed decode steps of one
sequence, two in flight as in serving (``--no-overlap``: one), so that step i + 1 is
launched before step i's token reaches the host. A step's time is the gap
between two results arriving on the host: it includes sampling and the copy back. When the
runner captures CUDA graphs (not ``--enforce-eager``), the decode steps replay them.

The roofline of a decode step is (weight bytes + KV bytes of the context) over the copy
bandwidth measured here; tok/s at the roofline is its inverse.

``--without attention,rotary`` leaves those parts out of the decode steps
(tools/step_ablation.py): how long each holds a step up, with the tokens no longer the
model's.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from typing import Any

from tools.bench_common import (
    Roofline,
    measure_roofline,
    parse_int_list,
    pct,
    print_table,
    progress,
    run_metadata,
    save_json,
    save_plot,
    synchronize,
)
from tools.bench_model import (
    ModelShape,
    decode_roofline_s,
    load_model_shape,
    prefill_roofline_s,
)
from tools.latency_profile import profile_decode_steps
from tools.step_ablation import parse_parts, without

BLOCK_SIZE = 16
# Sequence ids of the repeated prefills, clear of the contexts' own (0, 1, ...).
EXTRA_SEQ_IDS = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    p.add_argument("--contexts", default="128,4096", help="context lengths, comma separated")
    p.add_argument("--steps", type=int, default=256, help="timed decode steps per context")
    p.add_argument("--warmup-steps", type=int, default=16)
    p.add_argument(
        "--prefill-repeats",
        type=int,
        default=3,
        help="prefill each context this many times and report the median",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="one step in flight: launch each step after the previous token reached the host",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rope-scaling",
        default="",
        help="rope scaling over the model's, as pegainfer takes it, for contexts past its "
        'positions, e.g. \'{"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 32768}\'',
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also profile decode steps at the first context and print where the GPU time goes",
    )
    p.add_argument(
        "--without",
        default="",
        help="decode-step parts to leave out, comma separated (attention, rotary): timing "
        "only, the tokens are then not the model's",
    )
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="latency")
    return p


def make_runner(args: argparse.Namespace, max_model_len: int, shape: ModelShape) -> Any:
    from pegainfer.config import EngineConfig, finalize, read_model_info
    from pegainfer.gc_control import settle_heap
    from pegainfer.hf_config import parse_hf_overrides
    from worker_proc.model_runner import ModelRunner

    # Exactly the blocks one sequence needs (plus one spare): no profile run, a fast start.
    blocks = -(-max_model_len // BLOCK_SIZE) + 1
    overrides = parse_hf_overrides("", args.rope_scaling)
    config = EngineConfig(
        model_path=args.model_path,
        served_model_name="bench",
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=1,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        kv_cache_memory=blocks * BLOCK_SIZE * shape.kv_bytes_per_token,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        hf_overrides=overrides,
        model=read_model_info(args.model_path, overrides),
    )
    runner = ModelRunner(finalize(config), 0)
    settle_heap("bench")  # as the worker does once it is ready
    from kernels.compile_watch import watch_late_compiles

    watch_late_compiles("bench")  # a compile inside a timed step is named, as in the worker
    return runner


def run_context(
    runner: Any,
    context: int,
    steps: int,
    warmup: int,
    seq_id: int,
    seed: int,
    in_flight: int,
    profiler: Any = None,
    prefill_repeats: int = 1,
) -> dict[str, Any]:
    """Prefill one sequence of ``context`` random tokens (``prefill_repeats`` times, the
    median timed), then time decode steps (all of them, warm-up included, inside
    ``profiler``'s window when one is given)."""
    from pegainfer.protocol import BlockTableUpdate, NewSequence, SamplingParams, StepPlan, pack_ids

    total = context + warmup + steps + 1
    blocks = list(range(-(-total // runner.block_size)))
    rng = random.Random(seed)
    vocab = runner.model_config.vocab_size
    prompt = [rng.randrange(min(100, vocab - 1), vocab) for _ in range(context)]
    sampling = SamplingParams(max_tokens=total, temperature=0.0, ignore_eos=True)
    chunk = max(1, runner.config.max_num_batched_tokens)
    step_id = 0

    def plan(
        computed: int, scheduled: int, new: list, updates: list, seq: int = seq_id
    ) -> StepPlan:
        nonlocal step_id
        step_id += 1
        return StepPlan(
            step_id,
            new,
            pack_ids([seq]),
            pack_ids([computed]),
            pack_ids([scheduled]),
            updates,
            b"",
        )

    def prefill(seq: int) -> float:
        synchronize(runner.device)
        began = time.perf_counter()
        computed = 0
        new = [NewSequence(seq, pack_ids(prompt), sampling, context)]
        updates = [BlockTableUpdate(seq, pack_ids(blocks))]
        while computed < context:
            count = min(chunk, context - computed)
            result = runner.execute(plan(computed, count, new, updates, seq))
            new, updates = [], []
            computed += count
        synchronize(runner.device)
        if len(result.token_ids) != 4:
            raise RuntimeError("the prefill's last step sampled no token")
        return time.perf_counter() - began

    def finish(seq: int) -> None:
        # Free the sequence on the runner (a plan with nothing to run but the finish).
        nonlocal step_id
        step_id += 1
        runner.execute(StepPlan(step_id, [], b"", b"", b"", [], pack_ids([seq])))

    # The same prompt prefilled again in the same blocks, each freed before the next; the
    # last one goes on to decode. A run's first prefill can carry one-off costs.
    prefill_runs = []
    for repeat in range(prefill_repeats - 1):
        prefill_runs.append(prefill(EXTRA_SEQ_IDS + repeat))
        finish(EXTRA_SEQ_IDS + repeat)
    prefill_runs.append(prefill(seq_id))
    computed = context

    # Steps are submitted ahead, ``in_flight`` at a time, as the serving loop does: with two,
    # step i + 1 is launched before step i's token reaches the host (the runner feeds it
    # forward on the device). A step's time is the gap between two results arriving.
    bar = progress(warmup + steps, f"context {context}", "step")
    done: list[float] = []
    pending = 0
    total_steps = warmup + steps
    synchronize(runner.device)
    if profiler is not None:
        profiler.start()
    done.append(time.perf_counter())
    while len(done) <= total_steps:
        while pending < in_flight and len(done) - 1 + pending < total_steps:
            runner.submit(plan(computed, 1, [], []))
            computed += 1
            pending += 1
        for result in runner.poll_results(wait=in_flight == 1):
            if len(result.token_ids) != 4:
                raise RuntimeError(f"decode step {result.step_id} sampled no token")
            done.append(time.perf_counter())
            pending -= 1
            bar.update(1)
    bar.close()
    if profiler is not None:
        synchronize(runner.device)
        profiler.stop()
    times = [done[i + 1] - done[i] for i in range(warmup, total_steps)]
    finish(seq_id)
    return {
        "context": context,
        "prefill_s": statistics.median(prefill_runs),
        "prefill_runs_s": prefill_runs,
        "step_s": times,
        "first_timed_context": context + warmup,
    }


def summarize_context(raw: dict[str, Any], shape: ModelShape, roof: Roofline) -> dict[str, Any]:
    times = raw["step_s"]
    mean_s = statistics.fmean(times)
    median_s = statistics.median(times)
    # Step i attends to first_timed_context + i tokens; the roofline uses their mean.
    contexts = [raw["first_timed_context"] + i for i in range(len(times))]
    roof_s = statistics.fmean(decode_roofline_s(shape, roof, [c]) for c in contexts)
    prefill_roof = prefill_roofline_s(shape, roof, [raw["context"]])
    return {
        "context": raw["context"],
        "steps": len(times),
        "ms_per_step_mean": mean_s * 1e3,
        "ms_per_step_median": median_s * 1e3,
        "ms_per_step_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
        # A host stall (a collection, a compile) shows here long before it moves the median.
        "ms_per_step_max": max(times) * 1e3,
        "slowest_steps": [
            {"step": i, "ms": times[i] * 1e3}
            for i in sorted(range(len(times)), key=times.__getitem__)[-3:][::-1]
        ],
        "tok_s": 1.0 / mean_s,
        "roofline_ms_per_step": roof_s * 1e3,
        "roofline_tok_s": 1.0 / roof_s,
        "pct_of_roofline": pct(roof_s, mean_s),
        "prefill_ms": raw["prefill_s"] * 1e3,
        "prefill_ms_runs": [t * 1e3 for t in raw["prefill_runs_s"]],
        "prefill_roofline_ms": prefill_roof * 1e3,
        "prefill_pct_of_roofline": pct(prefill_roof, raw["prefill_s"]),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    try:
        left_out = parse_parts(args.without)
    except ValueError as error:
        raise SystemExit(f"--without: {error}") from None
    with without(left_out):
        return run(args, argv, left_out)


def run(
    args: argparse.Namespace, argv: list[str] | None, left_out: tuple[str, ...]
) -> dict[str, Any]:
    contexts = parse_int_list(args.contexts)
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    if args.prefill_repeats < 1:
        raise SystemExit("--prefill-repeats must be at least 1")
    max_model_len = max(contexts) + args.warmup_steps + args.steps + 2

    started = time.perf_counter()
    import torch

    from tools.bench_common import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    shape = load_model_shape(args.model_path, dtype_bytes=dtype.itemsize)
    roof = measure_roofline(device, dtype)
    print(roof.describe(), flush=True)
    runner = make_runner(args, max_model_len, shape)
    init_s = time.perf_counter() - started
    graphs = getattr(runner, "graphs", None) is not None
    capture_s = getattr(runner, "graph_capture_seconds", 0.0)
    print(
        f"model runner ready in {init_s:.1f} s on {runner.device} "
        f"({str(runner.dtype).removeprefix('torch.')}, CUDA graphs "
        f"{f'captured in {capture_s:.1f} s' if graphs else 'off'}, "
        f"{'no overlap' if args.no_overlap else 'two steps in flight'}); "
        f"decode reads {shape.decode_weight_bytes / 1e9:.3f} GB of weights + "
        f"{shape.kv_bytes_per_token / 1024:.1f} KiB of KV per context token",
        flush=True,
    )

    in_flight = 1 if args.no_overlap else 2
    rows = []
    for i, context in enumerate(contexts):
        raw = run_context(
            runner,
            context,
            args.steps,
            args.warmup_steps,
            i,
            args.seed + i,
            in_flight,
            prefill_repeats=args.prefill_repeats,
        )
        rows.append(summarize_context(raw, shape, roof))
    profile_text = None
    if args.profile:
        seq_id = len(contexts)
        profile_text = profile_decode_steps(
            functools.partial(
                run_context,
                runner,
                contexts[0],
                args.steps,
                args.warmup_steps,
                seq_id,
                0,
                in_flight,
            ),  # fmt: skip
            runner.device.type,
            contexts[0],
            args.steps + args.warmup_steps,
            in_flight,
            shape,
            roof,
            args.out,
        )
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()

    missing = f", without {' and '.join(left_out)} (timing only)" if left_out else ""
    text = print_table(
        f"batch-1 decode, {shape.architecture}, {roof.dtype}, {roof.device}{missing}",
        [
            "context",
            "ms/step",
            "median ms",
            "max ms",
            "tok/s",
            "roofline ms",
            "roofline tok/s",
            "% of roofline",
            f"prefill ms (median of {args.prefill_repeats})",
            "prefill roofline ms",
        ],
        [
            [
                r["context"],
                r["ms_per_step_mean"],
                r["ms_per_step_median"],
                r["ms_per_step_max"],
                r["tok_s"],
                r["roofline_ms_per_step"],
                r["roofline_tok_s"],
                r["pct_of_roofline"],
                r["prefill_ms"],
                r["prefill_roofline_ms"],
            ]
            for r in rows
        ],
    )
    print(roof.describe() + "; target: >= 85% of roofline at batch 1")
    for r in rows:
        slowest = ", ".join(f"#{s['step']} {s['ms']:.2f} ms" for s in r["slowest_steps"])
        print(f"context {r['context']}: slowest timed steps {slowest}")
    from kernels.compile_watch import late_compiles

    watch = late_compiles()
    if watch is not None:
        print(watch.summary())
    payload = {
        "benchmark": "latency",
        "meta": run_metadata(argv),
        "args": vars(args),
        "roofline": roof,
        "model_shape": shape,
        "runner_init_s": init_s,
        "results": rows,
        "table": text,
        "profile": profile_text,
    }
    save_json(args.out, args.name, payload)

    def draw(axes: list) -> None:
        labels = [str(r["context"]) for r in rows]
        x = range(len(rows))
        axes[0].bar([i - 0.2 for i in x], [r["tok_s"] for r in rows], 0.4, label="measured")
        axes[0].bar(
            [i + 0.2 for i in x], [r["roofline_tok_s"] for r in rows], 0.4, label="roofline"
        )
        axes[0].set_xticks(list(x), labels)
        axes[0].set_xlabel("context tokens")
        axes[0].set_ylabel("decode tok/s (batch 1)")
        axes[0].legend()
        for i, r in enumerate(rows):
            axes[0].annotate(f"{r['pct_of_roofline']:.0f}%", (i - 0.2, r["tok_s"]), ha="center")

    save_plot(args.out, args.name, draw, f"batch-1 decode vs roofline ({roof.device})")
    return payload


if __name__ == "__main__":
    main()
