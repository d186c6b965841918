"""Online serving benchmark: an OpenAI-API load generator against a running server, in the
manner of `vllm bench serve`.

    python -m tools.bench_serving --url http://127.0.0.1:8000 --num-prompts 200 \
        --request-rate 8 --input-len 1024 --output-len 128 --out bench_results

Prompts are random token ids (exact lengths, no tokenizer needed), lengths uniform in
``len * (1 ± range)``. Requests arrive as a Poisson process at ``--request-rate`` (inf: all at
once), at most ``--concurrency`` in flight. It talks only to ``--url``.

With ``--launch --model-path DIR`` it starts the server itself (127.0.0.1, a free port, after
measuring the roofline so that the server's profile run sees a free GPU) and stops it after.

Beside TPOT and ITL it prints the decode-step roofline at the concurrency the run reached
(Little's law) and the mean context, measured on ``--roofline-device`` in this run, when the
checkpoint's config.json is readable here (``--model-path``, or the server's /v1/models root).

One run's TPOT moves with how the arrivals fall into steps (by up to 30% between runs of the
same code on one H200 at 32 requests/s), so versions are compared over alternated runs: the
JSON's ``results`` hold a row per latency for ``bench_ab --key metric --metric mean``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from typing import Any

from tools.bench_client import (
    aggregate,
    clamp_vocab_range,
    random_token_prompts,
    run_async,
    run_load,
    served_model,
    stream_completion,
    uniform_lengths,
)
from tools.bench_common import (
    Roofline,
    fmt,
    measure_roofline,
    pct,
    print_table,
    progress,
    resolve_device,
    resolve_dtype,
    run_metadata,
    save_json,
    save_plot,
)
from tools.bench_model import (
    ModelShape,
    decode_roofline_s,
    load_model_shape,
)
from tools.bench_sampler import PRESETS as SAMPLING_PRESETS

# The latencies of a run's summary, each mean, p50, p90 and p99 in ms.
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
# --sampling's choice of sending no sampling field, as `vllm bench serve` does.
SERVER_DEFAULTS = "server"


# --structured: a constraint on every answer (structured output). Each leaves room for the
# whole output: with ignore_eos, an answer whose grammar has ended goes on unconstrained.
STRUCTURED = {
    "none": {},
    "json": {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "notes",
                "schema": {
                    "type": "object",
                    "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
                    "required": ["notes"],
                },
            },
        }
    },
    "regex": {"structured_outputs": {"regex": "[a-z ,.]+"}},
}


def request_sampling(
    choice: str, structured: str = "none", regex: str | None = None
) -> list[dict[str, Any]]:
    """Each request's sampling fields; a None field is left out of the request. ``regex``
    replaces the pattern of ``structured`` "regex"."""
    presets = [{"temperature": None}] if choice == SERVER_DEFAULTS else SAMPLING_PRESETS[choice]
    constraint = STRUCTURED[structured]
    if structured == "regex" and regex is not None:
        constraint = {"structured_outputs": {"regex": regex}}
    return [{**preset, **constraint} for preset in presets]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf: burst)")
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--input-len-range", type=float, default=0.0, help="uniform ±fraction")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-len-range", type=float, default=0.0, help="uniform ±fraction")
    p.add_argument("--vocab-range", type=int, nargs=2, default=(100, 10000), metavar=("LO", "HI"))
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) first")
    p.add_argument("--max-duration", type=float, default=600.0, help="seconds; then stop")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sampling",
        choices=[*SAMPLING_PRESETS, SERVER_DEFAULTS],
        default="greedy",
        help="the requests' sampling settings (tools/bench_sampler.py's presets; qwen3: "
        "temperature 0.6, top-p 0.95, top-k 20; server: no sampling field, so the server's "
        "defaults, e.g. the model's generation_config.json)",
    )
    p.add_argument(
        "--structured",
        choices=list(STRUCTURED),
        default="none",
        help="constrain every answer: json (a JSON schema), regex, or none",
    )
    p.add_argument(
        "--regex",
        default=None,
        help="the pattern of --structured regex (default [a-z ,.]+; ([a-z ,.])+ is the same "
        "language in a form the scheduler does not write out)",
    )
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="completions of token ids, or chat turns of the same prompts as text (decoded "
        "with the checkpoint's tokenizer.json; a reasoning model thinks, and its reasoning "
        "counts as output)",
    )
    p.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default=None,
        help="with --endpoint chat, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument("--model-path", default=None, help="checkpoint dir, for the roofline")
    p.add_argument(
        "--launch",
        action="store_true",
        help="start `pegainfer --model-path MODEL_PATH SERVER_ARGS` on 127.0.0.1 (a free port, "
        "--url ignored), run against it, stop it",
    )
    p.add_argument("--server-args", default="", help="extra pegainfer arguments (--launch)")
    p.add_argument("--roofline-device", default="auto", help="auto, cpu, cuda, none")
    p.add_argument("--dtype", default="auto", help="dtype the server runs, for the roofline")
    p.add_argument("--out", default="bench_results", help="directory for JSON and PNG")
    p.add_argument("--name", default="serving", help="file name stem of the outputs")
    return p


def measure_for_roofline(
    args: argparse.Namespace, model_path: str | None
) -> tuple[Roofline, ModelShape] | None:
    """The rates of ``--roofline-device`` and the model's shape, if its config is readable."""
    if args.roofline_device == "none" or not model_path:
        return None
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        print(f"no roofline: {model_path}/config.json is not readable here", file=sys.stderr)
        return None
    device = resolve_device(args.roofline_device)
    dtype = resolve_dtype(args.dtype, device)
    return measure_roofline(device, dtype), load_model_shape(model_path, dtype.itemsize)


def serving_roofline(
    measured: tuple[Roofline, ModelShape] | None, summary: dict[str, Any]
) -> dict[str, Any] | None:
    """The decode-step floor at the concurrency (Little's law) and mean context of the run."""
    if measured is None:
        return None
    roof, shape = measured
    batch = max(1, round(summary["mean_concurrency"]))
    completed = max(summary["completed"], 1)
    mean_in = summary["total_input_tokens"] / completed
    mean_out = summary["total_output_tokens"] / completed
    context = int(mean_in + mean_out / 2)
    step_s = decode_roofline_s(shape, roof, [context] * batch)
    return {
        "roofline": roof,
        "batch": batch,
        "context": context,
        "step_ms": step_s * 1e3,
        "output_tok_s": batch / step_s,
    }


def report(summary: dict[str, Any], roof: dict[str, Any] | None) -> str:
    step_ms = roof["step_ms"] if roof else None
    rows = []
    for key, label in (
        ("ttft_ms", "TTFT ms"),
        ("tpot_ms", "TPOT ms"),
        ("itl_ms", "ITL ms"),
        ("e2el_ms", "E2E latency ms"),
    ):
        s = summary[key]
        floor = step_ms if key in ("tpot_ms", "itl_ms") else None
        of_roof = pct(floor, s["p50"]) if floor else None
        rows.append([label, s["mean"], s["p50"], s["p90"], s["p99"], floor, of_roof])
    text = print_table(
        "latency",
        ["metric", "mean", "p50", "p90", "p99", "roofline step ms", "% of roofline (p50)"],
        rows,
    )
    roof_tok = roof["output_tok_s"] if roof else None
    rows = [
        ["completed / failed", f"{summary['completed']} / {summary['failed']}", None, None],
        ["duration s", summary["duration_s"], None, None],
        ["request throughput req/s", summary["request_throughput"], None, None],
        [
            "output throughput tok/s",
            summary["output_throughput"],
            roof_tok,
            pct(summary["output_throughput"], roof_tok) if roof_tok else None,
        ],
        ["total token throughput tok/s", summary["total_token_throughput"], None, None],
        ["mean concurrency", summary["mean_concurrency"], None, None],
    ]
    text += "\n" + print_table("throughput", ["metric", "value", "roofline", "% of roofline"], rows)
    if roof:
        print(
            f"roofline: one decode step of batch {roof['batch']} at context {roof['context']}; "
            + roof["roofline"].describe()
        )
    if summary["errors"]:
        print("errors:", *summary["errors"], sep="\n  ")
    return text


def plot(args: argparse.Namespace, results: list, roof: dict[str, Any] | None) -> str:
    ok = [r for r in results if r.ok]

    def draw(axes: list) -> None:
        for ax, values, label in (
            (axes[0], [r.ttft * 1e3 for r in ok], "TTFT ms"),
            (axes[1], [g * 1e3 for r in ok for g in r.itl], "ITL ms"),
        ):
            values = sorted(v for v in values if not math.isnan(v))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
            ax.set_xlabel(label)
            ax.set_ylabel("fraction of samples")
            ax.grid(alpha=0.3)
        if roof:
            axes[1].axvline(roof["step_ms"], color="red", linestyle="--", label="roofline step")
            axes[1].legend()

    rate = "burst" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    return save_plot(
        args.out,
        args.name,
        draw,
        f"serving: {len(ok)} requests, {rate}, concurrency {args.concurrency or 'unbounded'}",
        ncols=2,
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--num-prompts, --input-len and --output-len must be at least 1")
    if not args.launch:
        model, root = served_model(args.url)
        measured = measure_for_roofline(args, args.model_path or root)
        return run_benchmark(args, args.url, args.model or model, root, measured, argv)
    if not args.model_path:
        raise SystemExit("--launch needs --model-path")
    from tools.bench_launch import ServerProcess

    # Measured first, so that the server's profile run finds the GPU free.
    measured = measure_for_roofline(args, args.model_path)
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, f"{args.name}-server.log")
    with ServerProcess(args.model_path, shlex.split(args.server_args), log_path=log) as server:
        ready_s = server.wait_ready()
        print(f"server ready in {ready_s:.1f} s (log: {log})", flush=True)
        model, root = served_model(server.base_url)
        return run_benchmark(args, server.base_url, args.model or model, root, measured, argv)


def chat_prompts(prompts: list[list[int]], model_path: str | None) -> list[str]:
    """The token-id prompts as text, for chat turns."""
    if not model_path or not os.path.isfile(os.path.join(model_path, "tokenizer.json")):
        raise SystemExit("--endpoint chat needs the checkpoint's tokenizer.json (--model-path)")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))
    return tokenizer.decode_batch(prompts)


def run_benchmark(
    args: argparse.Namespace,
    url: str,
    model: str,
    root: str | None,
    measured: tuple[Roofline, ModelShape] | None,
    argv: list[str] | None,
) -> dict[str, Any]:
    input_lens = uniform_lengths(args.num_prompts, args.input_len, args.input_len_range, args.seed)
    output_lens = uniform_lengths(
        args.num_prompts, args.output_len, args.output_len_range, args.seed + 1
    )
    vocab = clamp_vocab_range(args.vocab_range, args.model_path or root)
    prompts: list = random_token_prompts(input_lens, vocab, args.seed)
    if args.endpoint == "chat":
        prompts = chat_prompts(prompts, args.model_path or root)
    sampling = request_sampling(args.sampling, args.structured, args.regex)
    if args.chat_template_kwargs is not None:
        sampling = [{**s, "chat_template_kwargs": args.chat_template_kwargs} for s in sampling]

    async def go() -> tuple[list, float]:
        if args.warmup:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                for prompt in prompts[: args.warmup]:
                    warm = await stream_completion(session, url, model, prompt, 4)
                    if not warm.ok:
                        raise SystemExit(f"warm-up request failed: {warm.error}")
        bar = progress(len(prompts), "requests", "req")
        try:
            return await run_load(
                url,
                model,
                prompts,
                output_lens,
                request_rate=args.request_rate,
                concurrency=args.concurrency,
                ignore_eos=args.ignore_eos,
                seed=args.seed,
                max_duration=args.max_duration,
                request_timeout=args.request_timeout,
                on_done=lambda _: bar.update(1),
                sampling=sampling,
            )
        finally:
            bar.close()

    results, duration = run_async(go())
    summary = aggregate(results, duration)
    roof = serving_roofline(measured, summary)
    print(
        f"serving benchmark: {url} model {model}, {args.num_prompts} prompts, input "
        f"{args.input_len}±{args.input_len_range:g}, output {args.output_len}"
        f"±{args.output_len_range:g}, rate {fmt(args.request_rate)}, concurrency "
        f"{args.concurrency or 'unbounded'}, {args.sampling} sampling"
        + ("" if args.structured == "none" else f", {args.structured} constraint")
        + (", chat" if args.endpoint == "chat" else "")
    )
    text = report(summary, roof)
    payload = {
        "benchmark": "serving",
        "meta": run_metadata(argv),
        "args": vars(args),
        "url": url,
        "model": model,
        "summary": summary,
        # One row a latency, so that ``bench_ab --key metric --metric mean`` compares versions
        # over alternated runs: one run moves with how the arrivals fall into steps.
        "results": [{"metric": name, **summary[name]} for name in LATENCIES],
        "roofline": roof,
        "table": text,
        "requests": [
            {
                "ok": r.ok,
                "prompt_len": r.prompt_len,
                "output_tokens": r.output_tokens,
                "ttft_ms": r.ttft * 1e3,
                "latency_ms": r.latency * 1e3,
                "error": r.error,
            }
            for r in results
        ],
    }
    save_json(args.out, args.name, payload)
    plot(args, results, roof)
    return payload


if __name__ == "__main__":
    main()
