"""Prefix cache benchmark: cold vs warm time to first token for long shared prefixes.

    python -m tools.bench_prefix_cache --model-path DIR [--lengths 1024,4096,16384]
    python -m tools.bench_prefix_cache --url http://127.0.0.1:8000

For every length L and repetition: a fresh random prefix of L - tail tokens (token ids, so
nothing is cached from before) is sent with one random tail ("cold": the whole prompt is
prefilled), then with another tail ("warm": the prefix comes from the cache and only the
tail is computed). Each is a streamed /v1/completions request with max_tokens=1; TTFT is the
time from sending it to the first event that carries a choice. The table shows the medians,
the speedup, the cached tokens the server reported, and the floor of each prefill from the
roofline measured in the same run (cold: L tokens; warm: the tail, attending to L).

With --model-path it starts the server itself (after measuring the roofline, so the profile
run sees a free GPU) with --server-args added; with --url it talks to a running one.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tools.bench_client import served_model
from tools.bench_common import (
    Roofline,
    load_model_shape,
    measure_roofline,
    parse_int_list,
    print_table,
    progress,
    resolve_device,
    resolve_dtype,
    run_metadata,
    save_json,
    save_plot,
)
from tools.bench_launch import ServerProcess

TARGET_WARM_MS_4K = 10.0
TARGET_SPEEDUP = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="start a server on this checkpoint")
    p.add_argument("--url", default=None, help="or use the server running at this base URL")
    p.add_argument(
        "--server-args", default="", help="extra pegainfer arguments, e.g. '--max-model-len 20000'"
    )
    p.add_argument("--lengths", default="1024,4096,16384", help="prompt lengths in tokens")
    p.add_argument("--tail", type=int, default=32, help="tokens that differ between prompts")
    p.add_argument("--repeats", type=int, default=5, help="fresh prefixes per length (median)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted requests sent first")
    p.add_argument("--vocab-range", type=int, nargs=2, default=(100, 10000), metavar=("LO", "HI"))
    p.add_argument("--roofline-device", default="auto", help="auto, cpu, cuda, none")
    p.add_argument("--dtype", default="auto", help="the dtype the server runs, for the roofline")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_results", help="directory for JSON and PNG")
    p.add_argument("--name", default="prefix_cache", help="file name stem of the outputs")
    return p


@dataclass
class Sample:
    ttft_s: float
    cached_tokens: int
    prompt_tokens: int


class StreamingClient:
    """Streamed completions over one kept-alive HTTP connection (no connect time in TTFT)."""

    def __init__(self, base_url: str, model: str, timeout: float) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.prefix = parsed.path.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def ttft(self, prompt: list[int]) -> Sample:
        body = json.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        headers = {"Content-Type": "application/json"}
        try:
            return self._send(body, headers)
        except (http.client.HTTPException, ConnectionError):
            # The server closed the kept-alive connection: once more on a fresh one.
            self.conn.close()
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            return self._send(body, headers)

    def _send(self, body: bytes, headers: dict[str, str]) -> Sample:
        started = time.perf_counter()
        self.conn.request("POST", self.prefix + "/v1/completions", body, headers)
        resp = self.conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        first: float | None = None
        usage: dict[str, Any] = {}
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if first is None and chunk.get("choices"):
                first = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
        resp.read()  # drain, so that the connection can be reused
        if first is None:
            raise RuntimeError("the stream carried no choice")
        details = usage.get("prompt_tokens_details") or {}
        return Sample(
            ttft_s=first - started,
            cached_tokens=int(details.get("cached_tokens") or 0),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
        )


def measure_floor(args: argparse.Namespace, model_path: str | None) -> tuple[Any, Roofline] | None:
    """The model's shape and this machine's roofline, when both can be had."""
    if args.roofline_device == "none" or not model_path:
        return None
    try:
        device = resolve_device(args.roofline_device)
        dtype = resolve_dtype(args.dtype, device)
        shape = load_model_shape(model_path, dtype.itemsize)
        roof = measure_roofline(device, dtype)
    except (OSError, KeyError, ValueError, RuntimeError, ImportError) as exc:
        print(f"no roofline: {exc}", file=sys.stderr)
        return None
    print(roof.describe(), flush=True)
    return shape, roof


def floors_ms(floor: tuple[Any, Roofline] | None, length: int, tail: int) -> tuple[float, float]:
    """(cold, warm) prefill floors in ms: all L tokens, or the tail attending to L."""
    if floor is None:
        return math.nan, math.nan
    shape, roof = floor
    cold = roof.seconds(shape.step_flops([length], [length]), shape.prefill_bytes([length]))
    warm_bytes = shape.prefill_bytes([tail]) + (length - tail) * shape.kv_bytes_per_token
    warm = roof.seconds(shape.step_flops([tail], [length]), warm_bytes)
    return cold * 1e3, warm * 1e3


def run(args: argparse.Namespace, base_url: str, floor: tuple[Any, Roofline] | None) -> dict:
    lengths = parse_int_list(args.lengths)
    if min(lengths) <= args.tail:
        raise SystemExit(f"every length must exceed the tail of {args.tail} tokens")
    model, _ = served_model(base_url)
    client = StreamingClient(base_url, model, args.request_timeout)
    rng = random.Random(args.seed)
    low, high = args.vocab_range

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(n)]

    bar = progress(args.warmup + 2 * args.repeats * len(lengths), "requests", "req")
    for _ in range(args.warmup):
        client.ttft(tokens(min(lengths)))
        bar.update()
    results = []
    for length in lengths:
        cold: list[Sample] = []
        warm: list[Sample] = []
        for _ in range(args.repeats):
            prefix = tokens(length - args.tail)
            cold.append(client.ttft(prefix + tokens(args.tail)))
            bar.update()
            warm.append(client.ttft(prefix + tokens(args.tail)))
            bar.update()
        cold_ms = statistics.median(s.ttft_s for s in cold) * 1e3
        warm_ms = statistics.median(s.ttft_s for s in warm) * 1e3
        cold_floor, warm_floor = floors_ms(floor, length, args.tail)
        results.append(
            {
                "prompt_tokens": length,
                "cold_ttft_ms": cold_ms,
                "warm_ttft_ms": warm_ms,
                "speedup": cold_ms / warm_ms if warm_ms > 0 else math.nan,
                "warm_cached_tokens": int(statistics.median(s.cached_tokens for s in warm)),
                "cold_cached_tokens": max(s.cached_tokens for s in cold),
                "cold_floor_ms": cold_floor,
                "warm_floor_ms": warm_floor,
                "cold_samples_ms": [s.ttft_s * 1e3 for s in cold],
                "warm_samples_ms": [s.ttft_s * 1e3 for s in warm],
            }
        )
    bar.close()
    return {"model": model, "url": base_url, "results": results}


def report(args: argparse.Namespace, payload: dict) -> None:
    rows = [
        (
            r["prompt_tokens"],
            r["cold_ttft_ms"],
            r["cold_floor_ms"],
            r["warm_ttft_ms"],
            r["warm_floor_ms"],
            f"{r['speedup']:.1f}x",
            r["warm_cached_tokens"],
            r["cold_cached_tokens"],
        )
        for r in payload["results"]
    ]
    print_table(
        f"prefix cache: TTFT, median of {args.repeats} (prompts share all but the last "
        f"{args.tail} tokens; max_tokens=1)",
        [
            "prompt",
            "cold ms",
            "cold floor",
            "warm ms",
            "warm floor",
            "speedup",
            "cached (warm)",
            "cached (cold)",
        ],
        rows,
    )
    for r in payload["results"]:
        if r["prompt_tokens"] == 4096:
            met = r["warm_ttft_ms"] <= TARGET_WARM_MS_4K and r["speedup"] >= TARGET_SPEEDUP
            print(
                f"target (4k): warm <= {TARGET_WARM_MS_4K:.0f} ms and >= {TARGET_SPEEDUP:.0f}x "
                f"faster than cold: {'met' if met else 'NOT met'}"
            )
    save_json(args.out, args.name, payload)

    def draw(axes: list[Any]) -> None:
        ax = axes[0]
        labels = [str(r["prompt_tokens"]) for r in payload["results"]]
        x = range(len(labels))
        width = 0.38
        cold = [r["cold_ttft_ms"] for r in payload["results"]]
        warm = [r["warm_ttft_ms"] for r in payload["results"]]
        ax.bar([i - width / 2 for i in x], cold, width, label="cold (nothing cached)")
        ax.bar([i + width / 2 for i in x], warm, width, label="warm (prefix cached)")
        for i, r in enumerate(payload["results"]):
            ax.annotate(
                f"{r['speedup']:.1f}x",
                (i + width / 2, r["warm_ttft_ms"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT, ms (median)")
        ax.set_yscale("log")
        ax.set_ylim(top=max(cold + warm) * 4)  # room for the legend above the bars
        ax.legend(loc="upper left")

    save_plot(args.out, args.name, draw, f"prefix cache TTFT: {payload['model']}")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if bool(args.model_path) == bool(args.url):
        raise SystemExit("give exactly one of --model-path (start a server) and --url")
    model_path = args.model_path
    if args.url and model_path is None:
        try:
            model_path = served_model(args.url)[1]  # the checkpoint dir, if the server says
        except OSError:
            model_path = None
    floor = measure_floor(args, model_path)
    payload: dict[str, Any] = {"meta": run_metadata(argv), "args": vars(args)}
    if args.url:
        payload.update(run(args, args.url, floor))
    else:
        os.makedirs(args.out, exist_ok=True)
        log_path = os.path.join(args.out, f"{args.name}_server.log")
        with ServerProcess(args.model_path, shlex.split(args.server_args), log_path) as server:
            ready_s = server.wait_ready()
            print(f"server ready in {ready_s:.1f} s (log: {log_path})", flush=True)
            payload.update(run(args, server.base_url, floor))
    if floor is not None:
        payload["roofline"] = floor[1]
    report(args, payload)


if __name__ == "__main__":
    main()
