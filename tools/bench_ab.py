"""Alternate environment variants of one benchmark on one machine, and compare them.

    python -m tools.bench_ab --variant pdl-off:PEGAINFER_PDL=0 --variant pdl-on: \\
        --rounds 2 --out DIR -- \\
        python -m tools.bench_latency --model-path CKPT --contexts 128,4096 --steps 128

Figures move by a few percent between machines and over minutes on one machine, so two
versions are compared only when they ran alternately on the same one: each round runs every
variant once, in order, each in a fresh process (A B A B ...), and drift falls on all alike.
A variant is ``NAME:VAR=VALUE,VAR=VALUE`` (environment added to this process's), or
``NAME:`` for the environment as it is.

The benchmark gets ``--out DIR/NAME-rN`` appended and must write one JSON there whose
``results`` rows carry ``--key`` (e.g. ``context``, ``batch``) and ``--metric`` (e.g.
``ms_per_step_median``, ``step_ms``). The table gives each variant's metric per round, their
median, and the median against the first variant's; a JSON and a PNG of the same are saved.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from tools.bench_common import print_table, progress, run_metadata, save_json, save_plot


@dataclass(frozen=True)
class Variant:
    name: str
    env: dict[str, str]


def parse_variant(spec: str) -> Variant:
    name, sep, assignments = spec.partition(":")
    if not sep or not name or "/" in name:
        raise ValueError(f"variant {spec!r}: want NAME:VAR=VALUE,... (or NAME: for none)")
    env: dict[str, str] = {}
    last_var = None
    for item in filter(None, (part.strip() for part in assignments.split(","))):
        var, eq, value = item.partition("=")
        if (not eq or not var.isidentifier()) and last_var is not None:
            # A comma inside a value (PEGAINFER_LATE_LAUNCH=skinny_add,rotary, or
            # PEGAINFER_LINEAR_TILES=2560,9728=4,512,4): no variable name before the next "=".
            env[last_var] += "," + item
            continue
        if not eq or not var:
            raise ValueError(f"variant {spec!r}: {item!r} is not VAR=VALUE")
        env[var] = value
        last_var = var
    return Variant(name, env)


def read_rows(out_dir: str, key: str, metric: str) -> dict[Any, float]:
    """``key value -> metric`` from the one benchmark JSON with ``results`` in ``out_dir``."""
    found = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(path) as f:
            payload = json.load(f)
        if isinstance(payload, dict) and "results" in payload:
            found.append((path, payload["results"]))
    if len(found) != 1:
        raise ValueError(f"{out_dir}: want one benchmark JSON with results, found {len(found)}")
    path, results = found[0]
    rows = results if isinstance(results, list) else [results]
    try:
        return {row[key]: float(row[metric]) for row in rows}
    except KeyError as missing:
        raise ValueError(f"{path}: a results row lacks {missing}") from None


def run_variant(variant: Variant, command: list[str], out_dir: str, log_path: str) -> int:
    env = dict(os.environ, **variant.env)
    with open(log_path, "w") as log:
        done = subprocess.run(
            [*command, "--out", out_dir], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    return done.returncode


def compare(
    variants: list[Variant], measured: dict[str, list[dict[Any, float]]]
) -> tuple[list[str], list[list[Any]]]:
    """Table columns and rows: per key, each variant's rounds and median, and the ratio of
    each median to the first variant's."""
    keys = list(measured[variants[0].name][0])
    rounds = len(measured[variants[0].name])
    columns = ["key"]
    for variant in variants:
        columns += [f"{variant.name} r{r + 1}" for r in range(rounds)] + [f"{variant.name} med"]
    columns += [f"{v.name} / {variants[0].name}" for v in variants[1:]]
    rows = []
    for key in keys:
        row: list[Any] = [key]
        medians = []
        for variant in variants:
            values = [result[key] for result in measured[variant.name]]
            medians.append(statistics.median(values))
            row += values + [medians[-1]]
        row += [median / medians[0] for median in medians[1:]]
        rows.append(row)
    return columns, rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, help="NAME:VAR=VALUE,...")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--key", default="context", help="the results rows' key field")
    p.add_argument("--metric", default="ms_per_step_median", help="the field compared")
    p.add_argument("--out", default="bench_results/ab")
    p.add_argument("--name", default="ab")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the benchmark command")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("no benchmark command given after --")
    variants = [parse_variant(spec) for spec in args.variant]
    if len(variants) < 2 or len({v.name for v in variants}) != len(variants):
        raise SystemExit("want two or more variants with distinct names")
    os.makedirs(args.out, exist_ok=True)
    measured: dict[str, list[dict[Any, float]]] = {v.name: [] for v in variants}
    with progress(args.rounds * len(variants), "variant runs", unit="run") as bar:
        for round_index in range(args.rounds):
            for variant in variants:
                run_dir = os.path.join(args.out, f"{variant.name}-r{round_index + 1}")
                code = run_variant(variant, command, run_dir, run_dir + ".log")
                if code != 0:
                    print(f"{variant.name} round {round_index + 1} exited {code}: {run_dir}.log")
                    return 1
                measured[variant.name].append(read_rows(run_dir, args.key, args.metric))
                bar.update(1)
    columns, rows = compare(variants, measured)
    title = f"{args.metric} by {args.key}, {args.rounds} alternated rounds: {' '.join(command)}"
    table = print_table(title, columns, rows)
    save_json(
        args.out,
        args.name,
        {
            "benchmark": "ab",
            "meta": run_metadata(sys.argv if argv is None else ["bench_ab", *argv]),
            "variants": [{"name": v.name, "env": v.env} for v in variants],
            "key": args.key,
            "metric": args.metric,
            "measured": {name: [list(r.items()) for r in runs] for name, runs in measured.items()},
            "table": table,
        },
    )

    def draw(axes: list) -> None:
        width = 0.8 / len(variants)
        for index, variant in enumerate(variants):
            medians = [row[1 + (args.rounds + 1) * index + args.rounds] for row in rows]
            positions = [i + index * width for i in range(len(rows))]
            axes[0].bar(positions, medians, width, label=variant.name)
        axes[0].set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
        axes[0].set_xticklabels([str(row[0]) for row in rows])
        axes[0].set_xlabel(args.key)
        axes[0].set_ylabel(f"{args.metric} (median of {args.rounds})")
        axes[0].legend()

    save_plot(args.out, args.name, draw, f"{args.metric}, variants alternated")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
