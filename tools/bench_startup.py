"""Startup: time from launching `pegainfer --model-path DIR` to HTTP ready (/health 200), to
the first token of a request sent as soon as it is ready, and the resident host memory of the
whole process tree once loaded and idle.

    python -m tools.bench_startup --model-path DIR --runs 3 --out DIR

Memory is read with psutil for the launcher and every child: RSS, and USS/PSS where the OS
reports them (Linux). RSS summed over processes counts shared pages (libraries, torch) once per
process; PSS shares them out, so its sum is the tree's real footprint. Medians over --runs.

The roofline printed beside the ready time is the least time the weights take to reach the
device: the checkpoint's bytes over the bandwidth of a copy from page-locked host memory,
measured in this run (the files are assumed to be in the page cache, as in the target; the
worker reads them into page-locked buffers). The worker's own phases, from its ``startup:``
log line, and the time at which each process was ready follow the main table.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import statistics
import time
from typing import Any

from pegainfer.startup_timeline import parse_timeline
from tools.bench_common import (
    measure_host_to_device_bandwidth,
    print_table,
    progress,
    resolve_device,
    run_metadata,
    save_json,
    save_plot,
)

READY_TARGET_S = 10.0
MEMORY_TARGET_BYTES = 1.5e9
MB = 1e6


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="default: the embedded default model")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--server-args", default="", help="extra pegainfer arguments")
    p.add_argument("--idle-seconds", type=float, default=2.0, help="wait before reading memory")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--device", default="auto", help="device for the roofline (auto, cpu, cuda)")
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="startup")
    return p


def one_run(args: argparse.Namespace, index: int) -> dict[str, Any]:
    from tools.bench_client import (
        clamp_vocab_range,
        random_token_prompts,
        run_async,
        served_model,
        stream_completion,
    )
    from tools.bench_launch import ServerProcess

    log = os.path.join(args.out, f"{args.name}-server-{index}.log")
    with ServerProcess(args.model_path, shlex.split(args.server_args), log_path=log) as server:
        ready_s = server.wait_ready(timeout=args.timeout, poll_s=0.02)
        model, root = served_model(server.base_url)
        vocab = clamp_vocab_range((100, 10000), args.model_path or root)
        prompt = random_token_prompts([args.prompt_len], vocab, index)[0]

        async def first_token() -> Any:
            import aiohttp

            async with aiohttp.ClientSession() as session:
                return await stream_completion(session, server.base_url, model, prompt, 2)

        result = run_async(first_token())
        if not result.ok:
            raise RuntimeError(f"the first request failed: {result.error}")
        # The request is timed with perf_counter, the launch with monotonic: convert.
        perf_to_monotonic = time.monotonic() - time.perf_counter()
        first_token_s = result.start + result.ttft + perf_to_monotonic - server.started
        time.sleep(args.idle_seconds)
        memory = server.memory()
        stop_began = time.monotonic()
        code = server.stop()
        stop_s = time.monotonic() - stop_began
    return {
        "ready_s": ready_s,
        "first_token_s": first_token_s,
        "stop_s": stop_s,
        "exit_code": code,
        "model_root": root,
        "memory": memory,
        **startup_breakdown(log),
    }


_MILESTONE = re.compile(
    r"pegainfer::launcher\[\d+\].* (\S+) ready \(pid \d+\) ([\d.]+) s after launch"
)


def startup_breakdown(log_path: str) -> dict[str, dict[str, float]]:
    """From a server log: worker-0's start-up phases (its ``startup:`` line) and the seconds
    after launch at which the launcher saw each process ready."""
    phases: dict[str, float] = {}
    milestones: dict[str, float] = {}
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                if "pegainfer::worker-0[" in line and not phases:
                    phases = parse_timeline(line) or {}
                match = _MILESTONE.search(line)
                if match:
                    milestones[match.group(1)] = float(match.group(2))
    except OSError:
        pass
    return {"worker_phases": phases, "ready_after_launch": milestones}


def weights_bytes(model_dir: str | None) -> int:
    if not model_dir or not os.path.isdir(model_dir):
        return 0
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_dir, "*.safetensors")))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.runs < 1:
        raise SystemExit("--runs must be at least 1")
    os.makedirs(args.out, exist_ok=True)
    runs = []
    bar = progress(args.runs, "startup runs", "run")
    for i in range(args.runs):
        runs.append(one_run(args, i))
        bar.update(1)
    bar.close()

    device = resolve_device(args.device)
    model_dir = args.model_path or runs[0]["model_root"]
    nbytes = weights_bytes(model_dir)
    h2d = measure_host_to_device_bandwidth(device, pinned=True)
    floor_s = nbytes / h2d if nbytes else None

    ready = statistics.median(r["ready_s"] for r in runs)
    first = statistics.median(r["first_token_s"] for r in runs)
    rss = statistics.median(r["memory"].rss for r in runs)
    uss_values = [r["memory"].uss for r in runs]
    pss_values = [r["memory"].pss for r in runs]
    uss = statistics.median(uss_values) if None not in uss_values else None
    pss = statistics.median(pss_values) if None not in pss_values else None
    footprint = pss if pss is not None else rss

    text = print_table(
        f"startup of {model_dir} ({nbytes / 1e9:.2f} GB of weights), median of {args.runs} runs",
        ["figure", "value", "roofline", "target", "met"],
        [
            ["launch -> HTTP ready s", ready, floor_s, READY_TARGET_S, ready <= READY_TARGET_S],
            ["launch -> first token s", first, floor_s, None, None],
            ["tree RSS MB (summed)", rss / MB, None, None, None],
            ["tree USS MB (summed)", uss / MB if uss else None, None, None, None],
            [
                "tree PSS MB (summed)" if pss is not None else "tree RSS MB (no PSS here)",
                footprint / MB,
                None,
                MEMORY_TARGET_BYTES / MB,
                footprint <= MEMORY_TARGET_BYTES,
            ],
        ],
    )
    print(
        f"roofline: {nbytes / 1e9:.2f} GB of weights over the host-to-{device.type} copy "
        f"bandwidth from page-locked memory measured in this run, {h2d / 1e9:.1f} GB/s"
    )
    names = sorted({p.name for r in runs for p in r["memory"].processes})

    def per_process(name: str, field: str) -> float | None:
        values = [getattr(p, field) for r in runs for p in r["memory"].processes if p.name == name]
        values = [v for v in values if v is not None]
        return statistics.median(values) / MB if values else None

    text += "\n" + print_table(
        "resident memory per process, loaded and idle (median MB)",
        ["process", "RSS", "USS", "PSS"],
        [[n, per_process(n, "rss"), per_process(n, "uss"), per_process(n, "pss")] for n in names],
    )
    text += "\n" + print_table(
        "each run",
        ["run", "ready s", "first token s", "stop s", "exit", "RSS MB", "PSS MB"],
        [
            [
                i,
                r["ready_s"],
                r["first_token_s"],
                r["stop_s"],
                r["exit_code"],
                r["memory"].rss / MB,
                r["memory"].pss / MB if r["memory"].pss is not None else None,
            ]
            for i, r in enumerate(runs)
        ],
    )
    text += breakdown_tables(runs)
    payload = {
        "benchmark": "startup",
        "meta": run_metadata(argv),
        "args": vars(args),
        "model_dir": model_dir,
        "weights_bytes": nbytes,
        "host_to_device_bytes_per_s": h2d,
        "roofline_ready_s": floor_s,
        "median": {
            "ready_s": ready,
            "first_token_s": first,
            "rss_bytes": rss,
            "uss_bytes": uss,
            "pss_bytes": pss,
        },
        "targets": {"ready_s": READY_TARGET_S, "memory_bytes": MEMORY_TARGET_BYTES},
        "runs": runs,
        "table": text,
    }
    save_json(args.out, args.name, payload)

    def draw(axes: list) -> None:
        x = list(range(len(runs)))
        axes[0].bar([i - 0.2 for i in x], [r["ready_s"] for r in runs], 0.4, label="HTTP ready")
        axes[0].bar(
            [i + 0.2 for i in x], [r["first_token_s"] for r in runs], 0.4, label="first token"
        )
        axes[0].axhline(READY_TARGET_S, color="red", linestyle=":", label="target")
        if floor_s:
            axes[0].axhline(floor_s, color="black", linestyle="--", label="roofline")
        axes[0].set_xticks(x, [str(i) for i in x])
        axes[0].set_xlabel("run")
        axes[0].set_ylabel("seconds from launch")
        axes[0].legend()
        bottom = 0.0
        for name in names:
            value = per_process(name, "pss") or per_process(name, "rss") or 0.0
            axes[1].bar([0], [value], bottom=bottom, label=name)
            bottom += value
        axes[1].axhline(MEMORY_TARGET_BYTES / MB, color="red", linestyle=":", label="target")
        axes[1].set_xticks([0], ["PSS" if pss is not None else "RSS"])
        axes[1].set_ylabel("MB, loaded and idle")
        axes[1].legend(fontsize="small")
        draw_phases(axes[2], runs)

    save_plot(args.out, args.name, draw, f"startup and idle memory ({model_dir})", ncols=3)
    return payload


def draw_phases(axes: Any, runs: list[dict[str, Any]]) -> None:
    """Worker-0's start-up phases, stacked, one bar per run."""
    phases: list[str] = []
    for r in runs:
        phases += [p for p in r.get("worker_phases", {}) if p not in phases]
    bottoms = [0.0] * len(runs)
    for phase in phases:
        values = [r.get("worker_phases", {}).get(phase, 0.0) for r in runs]
        axes.bar(range(len(runs)), values, 0.6, bottom=bottoms, label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    axes.axhline(READY_TARGET_S, color="red", linestyle=":", label="target (tree ready)")
    axes.set_xticks(range(len(runs)), [str(i) for i in range(len(runs))])
    axes.set_xlabel("run")
    axes.set_ylabel("seconds, worker-0 from its creation")
    axes.set_title("where the worker's start-up goes")
    if phases:
        axes.legend(fontsize="small")


def breakdown_tables(runs: list[dict[str, Any]]) -> str:
    """Median seconds of worker-0's start-up phases, and of each process's ready time."""

    def medians(key: str) -> dict[str, float]:
        names: list[str] = []
        for r in runs:
            names += [n for n in r.get(key, {}) if n not in names]
        return {n: statistics.median(r[key][n] for r in runs if n in r.get(key, {})) for n in names}

    text = ""
    phases = medians("worker_phases")
    if phases:
        total = sum(phases.values())
        rows = [[name, seconds, 100.0 * seconds / total] for name, seconds in phases.items()]
        rows.append(["total", total, 100.0])
        text += "\n" + print_table(
            "where worker-0's start-up goes (median s; interpreter counts from its creation)",
            ["phase", "seconds", "%"],
            rows,
        )
    milestones = medians("ready_after_launch")
    if milestones:
        ordered = sorted(milestones.items(), key=lambda item: item[1])
        text += "\n" + print_table(
            "each process ready, seconds after launch (median)",
            ["process", "ready s"],
            [[name, seconds] for name, seconds in ordered],
        )
    return text


if __name__ == "__main__":
    main()
