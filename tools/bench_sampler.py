"""Sampling cost per decode step: the worker's sampler on a batch of logits, per preset.

Every benchmark but this one decodes greedily, which the decode graph does itself (its
argmax). A request that samples (the API's default temperature of 1, or Qwen3's own
settings: temperature 0.6, top-p 0.95, top-k 20) runs the sampler after the graph, eagerly,
every step. This times that call, ``Sampler.sample``, on random logits of the model's
vocabulary, for each preset and batch size, beside its floor: the logits' bytes read once
at the copy bandwidth measured in the same run.

    python -m tools.bench_sampler                       # on the GPU if there is one
    python -m tools.bench_sampler --batches 1,64 --presets temperature,qwen3

``ms`` is the time of one call when calls run back to back (CUDA events over ``--calls``
calls, so launches that the GPU waits for count); ``host ms`` is what enqueuing one call
costs the host. A whole step adds ``ms`` to the decode graph's time where the host keeps
up, which ``bench_throughput`` shows through its step times.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from typing import Any

from tools.bench_common import (
    dtype_name,
    fmt,
    measure_copy_bandwidth,
    parse_int_list,
    print_table,
    progress,
    resolve_device,
    resolve_dtype,
    run_metadata,
    save_json,
    save_plot,
    synchronize,
)

HISTORY = 1024 + 128
QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
PRESETS: dict[str, list[dict[str, Any]]] = {
    "greedy": [{"temperature": 0.0}],
    "temperature": [{"temperature": 1.0}],
    "qwen3": [QWEN3],
    "qwen3-seeded": [{**QWEN3, "seed": 7}],
    "top-p": [{"temperature": 1.0, "top_p": 0.9}],
    "min-p": [{"temperature": 1.0, "min_p": 0.05}],
    # Qwen3's advice against endless repetition: a presence penalty of 1.5.
    "qwen3-presence": [{**QWEN3, "presence_penalty": 1.5}],
    # Rows cycle through these: one batch, four kinds of request.
    "mixed": [
        {"temperature": 0.0},
        {"temperature": 1.0},
        QWEN3,
        {"temperature": 0.8, "top_p": 0.9},
    ],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="the logits' dtype (the model's)")
    p.add_argument("--vocab", type=int, default=151_936, help="Qwen3's vocabulary by default")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--presets", default=",".join(PRESETS), help=f"of {', '.join(PRESETS)}")
    p.add_argument("--calls", type=int, default=50, help="timed calls a case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="sampler")
    return p


def time_calls(fn: Any, device: Any, calls: int) -> tuple[float, float]:
    """(seconds a call back to back, host seconds to enqueue a call)."""
    import torch

    for _ in range(3):
        fn()
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - began) / calls
    if device.type == "cuda":
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls, host
    return host, host


def run_case(
    device: Any, dtype: Any, vocab: int, batch: int, settings: list[dict[str, Any]], calls: int
) -> tuple[float, float]:
    import torch

    from pegainfer.protocol import SamplingParams
    from worker_proc.sampler import Sampler, has_penalties

    generator = torch.Generator(device="cpu").manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=generator) * 3).to(device=device, dtype=dtype)
    positions = torch.arange(100, 100 + batch, device=device)
    params = [SamplingParams(**settings[i % len(settings)]) for i in range(batch)]
    sampler = Sampler(device, seed=0)
    # Penalised rows: a 1,024-token prompt and 128 generated tokens each.
    histories = [
        (torch.randint(0, vocab, (HISTORY,), generator=generator).tolist(), HISTORY - 128)
        for _ in range(batch)
    ]
    if "penalty_rows" not in inspect.signature(sampler.prepare).parameters:
        # A tree from before the penalty table: the rows' histories at every step.
        prepared = sampler.prepare(params, vocab)
        penalised = any(has_penalties(p) for p in params)
        extra = (histories,) if penalised else ()
        return time_calls(
            lambda: sampler.sample(logits, prepared, positions, *extra), device, calls
        )
    from worker_proc.penalties import PenaltyTable

    table = PenaltyTable(vocab, device, sampler.uploader)
    rows = [table.admit(*h) if has_penalties(p) else -1 for p, h in zip(params, histories)]
    prepared = sampler.prepare(params, vocab, rows)
    return time_calls(lambda: sampler.sample(logits, prepared, positions, table), device, calls)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    batches = parse_int_list(args.batches)
    presets = [name.strip() for name in args.presets.split(",") if name.strip()]
    unknown = [name for name in presets if name not in PRESETS]
    if unknown:
        print(f"unknown presets {unknown}; choose from {list(PRESETS)}", file=sys.stderr)
        return 2
    copy = measure_copy_bandwidth(device)
    # Reading the logits once takes half a copy's bytes per byte of logits.
    read_bandwidth = copy / 2
    element = 2 if dtype_name(dtype) in ("bfloat16", "float16") else 4
    print(
        f"{device} {dtype_name(dtype)} logits, vocabulary {args.vocab:,}; copy "
        f"{copy / 1e9:,.0f} GB/s (read + write)",
        flush=True,
    )
    rows, results = [], []
    bar = progress(len(batches) * len(presets), "sampler", "case")
    for preset in presets:
        for batch in batches:
            seconds, host = run_case(device, dtype, args.vocab, batch, PRESETS[preset], args.calls)
            floor = batch * args.vocab * element / read_bandwidth
            results.append(
                {
                    "preset": preset,
                    "batch": batch,
                    "ms": seconds * 1e3,
                    "host_ms": host * 1e3,
                    "floor_ms": floor * 1e3,
                    "times_floor": seconds / floor,
                }
            )
            rows.append(
                [preset, batch, fmt(seconds * 1e3, 3), fmt(host * 1e3, 3), fmt(floor * 1e3, 4),
                 fmt(seconds / floor, 1)]
            )  # fmt: skip
            bar.update(1)
    bar.close()
    print_table(
        "Sampler.sample per call (a decode step's sampling)",
        ["preset", "batch", "ms", "host ms", "floor ms", "x floor"],
        rows,
    )
    payload = {
        "meta": run_metadata(argv),
        "device": str(device),
        "dtype": dtype_name(dtype),
        "vocab": args.vocab,
        "copy_gbps": copy / 1e9,
        "presets": {name: PRESETS[name] for name in presets},
        "results": results,
    }
    save_json(args.out, args.name, payload)

    def draw(axes: list[Any]) -> None:
        for preset in presets:
            points = [r for r in results if r["preset"] == preset]
            axes[0].plot(
                [r["batch"] for r in points], [r["ms"] for r in points], "o-", label=preset
            )
        floors = [r for r in results if r["preset"] == presets[0]]
        axes[0].plot(
            [r["batch"] for r in floors], [r["floor_ms"] for r in floors], "k--", label="floor"
        )
        axes[0].set_xscale("log", base=2)
        axes[0].set_yscale("log")
        axes[0].set_xlabel("batch")
        axes[0].set_ylabel("ms a call")
        axes[0].legend(fontsize=8)

    save_plot(args.out, args.name, draw, f"Sampler.sample, {device}, vocabulary {args.vocab:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
