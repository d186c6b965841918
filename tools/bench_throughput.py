"""Offline throughput: a sweep of batch sizes at a fixed prompt and output length
(``ignore_eos``), with output tok/s and the decode step time beside their rooflines, and
optionally HF transformers ``generate`` on the same shapes as the baseline.

    python -m tools.bench_throughput --model-path DIR --batches 1,8,32,64,128,256 \
        --input-len 1024 --output-len 128 --hf-baseline --out DIR

``--engine server`` (the default) measures the real process tree: one `pegainfer` is started
with --max-num-seqs = the largest batch, and each batch is B concurrent streaming
/v1/completions requests with random token-id prompts. The decode step time is the median
inter-token latency seen by the clients; it includes every hop of the pipeline.
``--engine inprocess`` drives ``scheduler_proc.scheduler.Scheduler`` and
``worker_proc.model_runner.ModelRunner`` in one process, two steps in flight as the processes
do: the decode step time is then the median gap between results of consecutive steps that
decoded the full batch, with no IPC, HTTP or detokenization in it. ``--no-overlap`` runs one
step at a time in both engines.

Rooflines (measured in this run): a decode step of batch B reads the weights once plus the KV
cache of B contexts (the mean context of the run, input + output / 2); the whole run's floor
is the prefill of every prompt plus output - 1 such decode steps, which gives the roofline
output tok/s.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import Any

from tools.bench_client import clamp_vocab_range, random_token_prompts
from tools.bench_common import (
    Roofline,
    measure_roofline,
    parse_int_list,
    pct,
    print_table,
    progress,
    resolve_device,
    resolve_dtype,
    run_metadata,
    save_json,
    save_plot,
)
from tools.bench_inprocess import batched_tokens, sweep_inprocess
from tools.bench_model import (
    ModelShape,
    decode_roofline_s,
    generation_roofline_s,
    load_model_shape,
)
from tools.bench_sampler import PRESETS as SAMPLING_PRESETS
from tools.step_ablation import parse_parts, without


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--engine", choices=["server", "inprocess"], default="server")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: max(8192, input)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-overlap", action="store_true", help="one step in flight (both engines)")
    p.add_argument("--server-args", default="", help="extra pegainfer arguments (server)")
    p.add_argument(
        "--sampling",
        choices=list(SAMPLING_PRESETS),
        default="greedy",
        help="the requests' sampling settings (tools/bench_sampler.py's presets; qwen3: "
        "temperature 0.6, top-p 0.95, top-k 20)",
    )
    p.add_argument(
        "--profile-batches",
        type=parse_int_list,
        default=[],
        help="inprocess engine: profile full-batch decode steps at these batch sizes and print "
        "where the GPU time goes (per part of the step, beside its bytes' floor)",
    )
    p.add_argument("--profile-steps", type=int, default=32, help="decode steps profiled")
    p.add_argument(
        "--profile-prefill",
        action="store_true",
        help="inprocess engine: profile the prefill of the largest batch's prompts (each asking "
        "one token) and print where the GPU time goes, beside each part's FLOP or byte floor",
    )
    p.add_argument(
        "--without",
        default="",
        help="inprocess engine: decode-step parts to leave out, comma separated (attention, "
        "rotary; tools/step_ablation.py): timing only, the tokens are then not the model's",
    )
    p.add_argument("--hf-baseline", action="store_true", help="also run HF transformers generate")
    p.add_argument("--hf-batches", default="1,64")
    p.add_argument("--vocab-range", type=int, nargs=2, default=(100, 10000), metavar=("LO", "HI"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per batch")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="throughput")
    return p


# ---------------------------------------------------------------------------------------------
# pegainfer through the process tree
# ---------------------------------------------------------------------------------------------


def sweep_server(args: argparse.Namespace, batches: list[int]) -> list[dict[str, Any]]:
    from tools.bench_client import aggregate, run_async, run_load, served_model
    from tools.bench_launch import ServerProcess

    server_args = [
        "--max-num-seqs", str(max(batches)),
        "--max-model-len", str(args.input_len + args.output_len + 8),
        "--max-num-batched-tokens", str(batched_tokens(args)),
        "--device", args.device,
        "--dtype", args.dtype,
        "--no-prefix-cache",
    ]  # fmt: skip
    if args.enforce_eager:
        server_args.append("--enforce-eager")
    if args.no_overlap:
        server_args.append("--no-overlap")
    server_args += shlex.split(args.server_args)
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, f"{args.name}-server.log")
    rows = []
    with ServerProcess(args.model_path, server_args, log_path=log) as server:
        ready_s = server.wait_ready()
        print(f"server ready in {ready_s:.1f} s (log: {log})", flush=True)
        model, _ = served_model(server.base_url)
        # One short request first: lazy initialisation must not land in the first batch.
        vocab = clamp_vocab_range(args.vocab_range, args.model_path)
        warm = random_token_prompts([min(16, args.input_len)], vocab, 99)
        run_async(run_load(server.base_url, model, warm, [2]))
        for i, batch in enumerate(batches):
            prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + i)
            results, wall = _run_batch(args, server.base_url, model, prompts)
            summary = aggregate(results, wall)
            if summary["failed"]:
                # Keep what the other batches measured: device time is precious.
                error = f"{summary['failed']} of {batch} requests failed: {summary['errors']}"
                print(f"batch {batch}: {error}", flush=True)
                rows.append({"batch": batch, "error": error})
                continue
            rows.append(
                {
                    "batch": batch,
                    "wall_s": wall,
                    "output_tokens": summary["total_output_tokens"],
                    "output_tok_s": summary["output_throughput"],
                    "ttft_p50_ms": summary["ttft_ms"]["p50"],
                    "step_ms": summary["itl_ms"]["p50"],
                    "step_p90_ms": summary["itl_ms"]["p90"],
                }
            )
    return rows


def _run_batch(
    args: argparse.Namespace, base_url: str, model: str, prompts: list[list[int]]
) -> tuple[list[Any], float]:
    from tools.bench_client import run_async, run_load

    bar = progress(len(prompts), f"batch {len(prompts)}", "req")
    try:
        return run_async(
            run_load(
                base_url,
                model,
                prompts,
                [args.output_len] * len(prompts),
                concurrency=len(prompts),
                max_duration=args.timeout,
                request_timeout=args.timeout,
                on_done=lambda _: bar.update(1),
                sampling=args.sampling_settings,
            )
        )
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------
# HF transformers baseline
# ---------------------------------------------------------------------------------------------


def _hf_generate(model: Any, input_ids: Any, num_tokens: int) -> Any:
    import torch

    with torch.inference_mode():
        return model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,  # eos cannot end it early
            do_sample=False,
            pad_token_id=0,
        )


def hf_baseline(args: argparse.Namespace, batches: list[int]) -> list[dict[str, Any]]:
    import torch
    from transformers import AutoModelForCausalLM

    from tools.bench_common import synchronize

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).to(device).eval()
    vocab = clamp_vocab_range(args.vocab_range, args.model_path)
    rows = []
    for i, batch in enumerate(batches):
        prompts = random_token_prompts([args.input_len] * batch, vocab, args.seed + i)
        input_ids = torch.tensor(prompts, device=device)
        _hf_generate(model, input_ids, 2)  # warm-up: kernels, allocator
        synchronize(device)
        began = time.perf_counter()
        out = _hf_generate(model, input_ids, args.output_len)
        synchronize(device)
        wall = time.perf_counter() - began
        tokens = (out.shape[1] - args.input_len) * batch
        rows.append({"batch": batch, "wall_s": wall, "output_tok_s": tokens / wall})
        print(f"HF transformers batch {batch}: {tokens / wall:.1f} output tok/s", flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def add_rooflines(
    rows: list[dict[str, Any]], args: argparse.Namespace, shape: ModelShape, roof: Roofline
) -> None:
    context = args.input_len + args.output_len // 2
    for row in rows:
        batch = row["batch"]
        step_roof_ms = decode_roofline_s(shape, roof, [context] * batch) * 1e3
        run_roof_s = generation_roofline_s(shape, roof, batch, args.input_len, args.output_len)
        row["roofline_step_ms"] = step_roof_ms
        step_ms = row.get("step_ms")
        row["step_x_roofline"] = step_ms / step_roof_ms if step_ms else None
        row["roofline_output_tok_s"] = batch * args.output_len / run_roof_s
        tok_s = row.get("output_tok_s")
        row["pct_of_roofline"] = pct(tok_s, row["roofline_output_tok_s"]) if tok_s else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    args.sampling_settings = SAMPLING_PRESETS[args.sampling]
    batches = parse_int_list(args.batches)
    hf_batches = parse_int_list(args.hf_batches)
    if args.profile_batches and (
        args.engine != "inprocess" or not set(args.profile_batches) <= set(batches)
    ):
        raise SystemExit("--profile-batches needs --engine inprocess and batches of --batches")
    if args.profile_prefill and args.engine != "inprocess":
        raise SystemExit("--profile-prefill needs --engine inprocess")
    try:
        left_out = parse_parts(args.without)
    except ValueError as error:
        raise SystemExit(f"--without: {error}") from None
    if left_out and args.engine != "inprocess":
        raise SystemExit("--without needs --engine inprocess")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    shape = load_model_shape(args.model_path, dtype_bytes=dtype.itemsize)
    roof = measure_roofline(device, dtype)
    print(roof.describe(), flush=True)

    if args.engine == "server":
        rows = sweep_server(args, batches)
    else:
        with without(left_out):
            rows = sweep_inprocess(args, batches, shape, roof)
    add_rooflines(rows, args, shape, roof)
    how = (
        "the process tree (HTTP streaming; step = median inter-token latency)"
        if args.engine == "server"
        else "an in-process Scheduler + ModelRunner (step = median gap between full-batch "
        "decode results)"
    )
    title = (
        f"offline throughput through {how}: {args.input_len} in, {args.output_len} out, "
        f"ignore_eos, {args.sampling} sampling, {shape.architecture}, {roof.dtype}, "
        f"{roof.device}" + (f", without {' and '.join(left_out)} (timing only)" if left_out else "")
    )
    text = print_table(
        title,
        [
            "batch",
            "wall s",
            "out tok/s",
            "roofline tok/s",
            "% of roofline",
            "TTFT p50 ms",
            "step ms",
            "roofline step ms",
            "step / roofline",
        ],
        [
            [
                r["batch"],
                r.get("wall_s"),
                r.get("output_tok_s"),
                r["roofline_output_tok_s"],
                r["pct_of_roofline"],
                r.get("ttft_p50_ms"),
                r.get("step_ms"),
                r["roofline_step_ms"],
                r["step_x_roofline"],
            ]
            for r in rows
        ],
    )
    print(roof.describe() + "; target: decode step <= 1.3x its roofline at batch 8-256")
    for row in rows:
        for key in ("profile_table", "prefill_profile_table"):
            if row.get(key):
                print("\n" + row[key], flush=True)
                text += "\n\n" + row[key]

    errors = [f"batch {r['batch']}: {r['error']}" for r in rows if r.get("error")]
    if errors:
        print("failed:", *errors, sep="\n  ")
    hf_rows: list[dict[str, Any]] = []
    hf_error = None
    if args.hf_baseline:
        try:
            hf_rows = hf_baseline(args, hf_batches)
        except Exception as exc:  # keep pegainfer's figures whatever transformers does
            hf_error = f"{type(exc).__name__}: {exc}"
            print(f"HF baseline failed: {hf_error}", flush=True)
        ours = {r["batch"]: r.get("output_tok_s") for r in rows}
        for row in hf_rows:
            mine = ours.get(row["batch"])
            row["pegainfer_tok_s"] = mine
            row["speedup"] = mine / row["output_tok_s"] if mine else None
            row["roofline_output_tok_s"] = (
                row["batch"]
                * args.output_len
                / generation_roofline_s(shape, roof, row["batch"], args.input_len, args.output_len)
            )
        text += "\n" + print_table(
            "HF transformers generate (greedy, same shapes) vs pegainfer; target >= 10x at batch 64",
            ["batch", "HF tok/s", "pegainfer tok/s", "speedup", "roofline tok/s"],
            [
                [
                    r["batch"],
                    r["output_tok_s"],
                    r["pegainfer_tok_s"],
                    r["speedup"],
                    r["roofline_output_tok_s"],
                ]
                for r in hf_rows
            ],
        )

    payload = {
        "benchmark": "throughput",
        "engine": args.engine,
        "measured_through": how,
        "meta": run_metadata(argv),
        "args": vars(args),
        "roofline": roof,
        "model_shape": shape,
        "results": rows,
        "hf_baseline": hf_rows,
        "hf_error": hf_error,
        "table": text,
    }
    save_json(args.out, args.name, payload)

    def draw(axes: list) -> None:
        b = [r["batch"] for r in rows]
        nan = float("nan")
        axes[0].plot(b, [r.get("output_tok_s") or nan for r in rows], "o-", label="pegainfer")
        axes[0].plot(b, [r["roofline_output_tok_s"] for r in rows], "k--", label="roofline")
        if hf_rows:
            axes[0].plot(
                [r["batch"] for r in hf_rows],
                [r["output_tok_s"] for r in hf_rows],
                "s-",
                label="HF transformers",
            )
        axes[0].set_ylabel("output tok/s")
        axes[1].plot(b, [r.get("step_ms") or nan for r in rows], "o-", label="decode step")
        axes[1].plot(b, [r["roofline_step_ms"] for r in rows], "k--", label="roofline")
        axes[1].plot(
            b, [1.3 * r["roofline_step_ms"] for r in rows], "r:", label="target 1.3x roofline"
        )
        axes[1].set_ylabel("ms per decode step")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(b, [str(x) for x in b])
            ax.set_xlabel("batch")
            ax.grid(alpha=0.3)
            ax.legend()

    save_plot(args.out, args.name, draw, title.split(":")[0] + f" ({roof.device})", ncols=2)
    return payload


if __name__ == "__main__":
    main()
