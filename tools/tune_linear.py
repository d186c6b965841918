"""Time the Triton linear kernels (kernels/linear.py) against cuBLAS at decode row counts.

    python -m tools.tune_linear [--preset 4b] [--rows 1,2,4,8,16,32,64] [--out DIR]

For every projection of the model shape (qkv, o, gate_up, down, lm_head) and every row
count, each candidate tile is timed inside one CUDA graph of ``--calls`` launches that cycle
through enough copies of the weight (at least ``--min-bytes``) that none comes from L2, as in
a real forward. The table gives cuBLAS (``F.linear``), the current default pick
(kernels/linear_configs.py) and the best candidate, each as microseconds and as bandwidth
beside the copy bandwidth measured in the same run. Candidates are compiled first in
``--jobs`` processes so the timing process finds them in Triton's cache.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import statistics
from collections.abc import Callable
from typing import Any

PRESETS = {
    # hidden, intermediate, q heads, kv heads, head_dim, vocab
    "0.6b": (1024, 3072, 16, 8, 128, 151936),
    "4b": (2560, 9728, 32, 8, 128, 151936),
    "8b": (4096, 12288, 32, 8, 128, 151936),
}


def projections(preset: str) -> list[tuple[str, int, int]]:
    hidden, inter, heads, kv_heads, head_dim, vocab = PRESETS[preset]
    return [
        ("qkv", (heads + 2 * kv_heads) * head_dim, hidden),
        ("o", hidden, heads * head_dim),
        ("gate_up", 2 * inter, hidden),
        ("down", hidden, inter),
        ("lm_head", vocab, hidden),
    ]


def candidates(rows: int) -> list[Any]:
    from kernels.linear import LinearConfig

    found = []
    if rows <= 8:
        block_m = 1 << (rows - 1).bit_length()
        for block_n, block_k, warps in itertools.product(
            (1, 2, 4, 8, 16), (128, 256, 512, 1024, 2048), (2, 4, 8)
        ):
            if block_m * block_n * block_k <= 4096 * warps and block_k >= 32 * warps:
                found.append(LinearConfig("gemv", block_n, block_k, warps, block_m))
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    for block_n, block_k, stages, split_k in itertools.product(
        (32, 64, 128), (64, 128, 256), (3, 5), (1, 2, 4, 8)
    ):
        if block_m * block_k + block_n * block_k > 64 * 256:
            continue  # too much shared memory per stage
        found.append(LinearConfig("dot", block_n, block_k, 4, block_m, split_k, stages))
    return found


def _compile_worker(tasks: list[tuple[int, int, int, Any]]) -> int:
    import torch

    from kernels.linear import linear_triton

    done = 0
    for rows, n, k, config in tasks:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        try:
            linear_triton(x, w, None, config)
            done += 1
        except Exception:  # a config that does not compile is skipped when timed too
            pass
    torch.cuda.synchronize()
    return done


def precompile(tasks: list[tuple[int, int, int, Any]], jobs: int) -> None:
    if jobs <= 1:
        _compile_worker(tasks)
        return
    chunks = [tasks[i::jobs] for i in range(jobs)]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_compile_worker, chunks)


def graph_time_us(make_call: Callable[[int], Callable[[], Any]], copies: int, calls: int) -> float:
    """Microseconds per call, from a CUDA graph of ``calls`` launches over rotating inputs."""
    import torch

    fns = [make_call(i % copies) for i in range(calls)]
    for fn in fns[:copies]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def measure_one(
    name: str, rows: int, weights: list[Any], calls: int, bar: Any, sweep: bool = True
) -> dict[str, Any]:
    """cuBLAS, the default pick and every candidate for one projection and row count."""
    import torch
    import torch.nn.functional as F

    from kernels.linear import linear_triton
    from kernels.linear_configs import pick_config

    n, k = weights[0].shape
    x = torch.randn(rows, k, device=weights[0].device, dtype=weights[0].dtype)

    def timed(fn: Callable[[Any], Any]) -> float:
        return graph_time_us(lambda i: lambda: fn(weights[i]), len(weights), calls)

    cublas = timed(lambda w: F.linear(x, w))
    bar.update()
    default_config = pick_config(rows, n, k)
    default = timed(lambda w: linear_triton(x, w, None, default_config))
    bar.update()
    results = [(default, default_config)]
    for config in candidates(rows) if sweep else []:
        try:
            results.append((timed(lambda w, c=config: linear_triton(x, w, None, c)), config))
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{name} rows={rows} {config}: {type(exc).__name__}: {exc}"[:300])
        bar.update()
    results.sort(key=lambda r: r[0])
    best_us, best = results[0]
    return {
        "projection": name,
        "rows": rows,
        "n": n,
        "k": k,
        "bytes": n * k * 2 + rows * (k + n) * 2,
        "cublas_us": cublas,
        "default_us": default,
        "default": vars(default_config),
        "best_us": best_us,
        "best": vars(best),
        "top5": [(round(us, 2), vars(c)) for us, c in results[:5]],
    }


def table_row(record: dict[str, Any], copy_bw: float) -> list[Any]:
    moved = record["bytes"]

    def bw(us: float) -> str:
        rate = moved / (us * 1e-6)
        return f"{rate / 1e12:.2f} ({rate / copy_bw:.0%})"

    best = record["best"]
    return [
        record["projection"],
        record["rows"],
        f"{record['cublas_us']:.1f}",
        bw(record["cublas_us"]),
        f"{record['default_us']:.1f}",
        bw(record["default_us"]),
        f"{record['best_us']:.1f}",
        bw(record["best_us"]),
        f"{best['kind']} m{best['block_m']} n{best['block_n']} k{best['block_k']} "
        f"w{best['num_warps']} s{best['num_stages']} sk{best['split_k']}",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="4b", choices=sorted(PRESETS))
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--only", default="", help="comma-separated projections (default: all)")
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--min-bytes", type=int, default=512 << 20)
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument(
        "--defaults-only", action="store_true", help="time cuBLAS and the default pick only"
    )
    p.add_argument("--out", default="bench_results")
    p.add_argument("--name", default="tune_linear")
    args = p.parse_args(argv)

    import torch

    from tools.bench_common import (
        measure_copy_bandwidth,
        parse_int_list,
        print_table,
        progress,
        run_metadata,
        save_json,
    )

    device = torch.device("cuda")
    rows_list = parse_int_list(args.rows)
    shapes = projections(args.preset)
    if args.only:
        keep = set(args.only.split(","))
        shapes = [s for s in shapes if s[0] in keep]
    # Compiled variants differ by K (whole chunks or not) and by rows (1 or more), not by N.
    tasks = [
        (rows, 256, k, config)
        for k in sorted({k for _, _, k in shapes})
        for rows in rows_list
        for config in candidates(rows)
    ]
    if not args.defaults_only:
        print(f"compiling {len(tasks)} kernels in {args.jobs} processes", flush=True)
        precompile(tasks, args.jobs)
    copy_bw = measure_copy_bandwidth(device)
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s", flush=True)

    per_rows = {r: 2 + (0 if args.defaults_only else len(candidates(r))) for r in rows_list}
    total = sum(per_rows.values()) * len(shapes)
    bar = progress(total, "tune", "config")
    records = []
    for name, n, k in shapes:
        copies = max(1, -(-args.min_bytes // (n * k * 2)))
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
        for rows in rows_list:
            records.append(
                measure_one(name, rows, weights, args.calls, bar, not args.defaults_only)
            )
        del weights
        torch.cuda.empty_cache()
    bar.close()
    table = [table_row(r, copy_bw) for r in records]
    print_table(
        f"linear at decode rows, bf16, {args.preset} (TB/s and share of copy bandwidth "
        f"{copy_bw / 1e12:.2f} TB/s)",
        [
            "proj",
            "rows",
            "cuBLAS us",
            "cuBLAS TB/s",
            "default us",
            "default TB/s",
            "best us",
            "best TB/s",
            "best config",
        ],
        table,
    )
    payload = {"meta": run_metadata(argv), "copy_bandwidth": copy_bw, "results": records}
    save_json(args.out, args.name, payload)
    return payload


if __name__ == "__main__":
    main()
