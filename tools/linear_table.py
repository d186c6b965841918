"""The tables of a ``tools/tune_linear`` sweep: its printed rows, and the skinny GEMM's table
file (kernels/linear_configs.py)."""

from __future__ import annotations

import json
import os
from typing import Any


def describe(config: dict[str, Any] | None) -> str:
    if config is None:
        return "cuBLAS"
    return (
        f"{config['kind']} m{config['block_m']} n{config['block_n']} k{config['block_k']} "
        f"w{config['num_warps']} s{config['num_stages']} sk{config['split_k']}"
        + (" paired" if config.get("paired") else "")
        + (f" g{config['groups']}" if config.get("groups") else "")
    )


def table_row(record: dict[str, Any], copy_bw: float) -> list[Any]:
    moved = record["bytes"]

    def bw(us: float) -> str:
        rate = moved / (us * 1e-6)
        return f"{rate / 1e12:.2f} ({rate / copy_bw:.0%})"

    return [
        record["projection"],
        record["rows"],
        f"{record['cublas_us']:.1f}",
        bw(record["cublas_us"]),
        f"{record['default_us']:.1f}",
        bw(record["default_us"]),
        f"{record['best_us']:.1f}",
        bw(record["best_us"]),
        describe(record["best"]),
    ]


def emit_table(records: list[dict[str, Any]], min_gain: float, device: str) -> dict[str, Any]:
    """The skinny GEMM's table from a sweep: per (padded rows, N, K, silu) the best tile of
    the largest row count swept there, or cuBLAS where none beats it by ``min_gain``."""
    from kernels.skinny_gemm import block_rows

    chosen: dict[tuple[int, int, int, bool], dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r["rows"]):
        if record["rows"] < 2:
            continue
        key = (block_rows(record["rows"]), record["n"], record["k"], record["silu_mul"])
        chosen[key] = record
    entries = []
    for (block_m, n, k, silu_mul), record in sorted(chosen.items()):
        entry: dict[str, Any] = {"block_m": block_m, "n": n, "k": k, "silu_mul": silu_mul}
        best = record["best"]
        wins = best is not None and record["best_us"] < record["cublas_us"] * (1 - min_gain)
        if wins and best["kind"] == "skinny":
            entry["kind"] = "skinny"
            for field in ("block_n", "block_k", "num_warps", "split_k", "num_stages", "paired"):
                entry[field] = best[field]
            if best.get("groups"):
                entry["groups"] = best["groups"]
        else:
            entry["kind"] = "cublas"
        entry["us"] = round(record["best_us"] if wins else record["cublas_us"], 2)
        entry["cublas_us"] = round(record["cublas_us"], 2)
        entry["swept_rows"] = record["rows"]
        entries.append(entry)
    return {"device": device, "source": "python -m tools.tune_linear", "entries": entries}


def write_table(
    records: list[dict[str, Any]], path: str, min_gain: float, device: str, keep_notes: bool
) -> dict[str, Any]:
    """Write ``emit_table``'s table to ``path``. With ``keep_notes`` the entries of a table
    already there that were set by hand (with a ``note``) stay in place of the sweep's."""
    from kernels.linear_configs import keep_hand_set

    table = emit_table(records, min_gain, device)
    if keep_notes and os.path.isfile(path):
        with open(path) as f:
            for entry in keep_hand_set(table, json.load(f)):
                print(
                    f"kept the hand-set entry of {entry['block_m']} rows, {entry['n']} x {entry['k']}"
                )
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"wrote {len(table['entries'])} table entries to {path}")
    return table
