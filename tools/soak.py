"""Soak test: moderate load on a pegainfer tree for a long time, watching its memory.

Starts the server (the embedded default model unless ``--model-path``), or uses a running
one (``--url`` plus ``--launcher-pid``), runs ``--concurrency`` clients that send a mix of
streaming and non-streaming completions and chats (some cancelled halfway, some invalid),
and samples the resident memory of every process of the tree. After ``--warmup`` seconds it
fits a line through the tree's total RSS and reports whether memory grows: a leak shows up
as a steady slope, while allocator noise does not. It fails on any lost request as well: a
5xx other than 503, an error event in a stream, a broken connection, or a request still
open two minutes after the load ends; and, when it started the server, on any process of
the tree still running 10 s after the launcher has exited on SIGTERM.

    python -m tools.soak --duration 600            # the 10-minute soak
    python -m tools.soak --duration 60 --warmup 20 # a quick look

On the CPU the KV cache's host pages are touched lazily, as blocks are first used, so a
large cache makes RSS climb for a while without any leak. The default server arguments
therefore use a small cache (64 MiB), and the run starts by prefilling long distinct prompts
(``--fill-kv-tokens``) so that every block has been touched before memory is judged.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import psutil

DEFAULT_SERVER_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "1024")
HANG_AFTER_S = 120.0
EXIT_GRACE_S = 10.0
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain recursion in one sentence.",
    "你好，请介绍一下你自己。",
    "Emoji story: 🐱🚀",
]


@dataclass
class Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: int = 0
    refused: int = 0  # 4xx on purpose, or 503 from overload
    cancelled: int = 0
    failed: int = 0  # a 5xx other than 503, an error event, a broken connection, a hang
    tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)  # of the responses that were not 200
    errors: list[str] = field(default_factory=list)

    def add(self, outcome: str, tokens: int = 0, error: str | None = None) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            self.tokens += tokens
            if error and len(self.errors) < 20:
                self.errors.append(error)

    def add_status(self, status: int, body: bytes) -> None:
        """A response that was not 200: refused when the server meant it (4xx, or 503 while
        overloaded), failed when the server broke (any other 5xx)."""
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
        if status >= 500 and status != 503:
            self.add("failed", error=f"HTTP {status}: {body[:200].decode(errors='replace')}")
        else:
            self.add("refused")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


# Structured output: each kind of constraint, and one that does not compile (a 400 from the
# scheduler, after the request was accepted).
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
_CONSTRAINT_FIELDS = ("structured_outputs", "guided_regex", "response_format")
CONSTRAINTS = (
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"guided_regex": "[a-z]{2,12}( [a-z]{2,12}){0,3}"},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "reply",
                "schema": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                    "required": ["ok"],
                },
            },
        }
    },
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"grammar": 'start: WORD ("," WORD)*\n%import common.WORD'}},
    {
        "response_format": {
            "type": "structural_tag",
            "triggers": ["<call="],
            "structures": [{"begin": "<call=f>", "schema": {"type": "object"}, "end": "</call>"}],
        }
    },
    {"guided_regex": "[0-9"},
)
# vLLM's extensions: each keeps per-request state somewhere (the worker's edits, the
# scheduler's bans, the prefix cache's salted roots).
EXTENSIONS = (
    {"allowed_token_ids": list(range(100, 600))},
    {"bad_words": ["the", "and then", "of the"]},
    {"cache_salt": "tenant-a"},
    {"cache_salt": "tenant-b"},
    {"truncate_prompt_tokens": 4},
)


def _request_body(rng: random.Random) -> tuple[str, dict]:
    max_tokens = rng.randint(4, 48)
    if rng.random() < 0.05:  # invalid on purpose: the server must shrug it off
        return "/v1/completions", {"prompt": "x", "max_tokens": -1}
    stream = rng.random() < 0.5
    common = {"max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
    # Each sampling path of the worker: Qwen3's settings (top-k candidates), penalties (a
    # row of token counts held while the request lives), seeds.
    # And none at all: the server's defaults (the model's generation_config.json).
    kind = rng.random()
    if kind < 0.25:
        common.update(temperature=0.6, top_p=0.95, top_k=20)
    elif kind < 0.4:
        common.update(presence_penalty=rng.choice([0.5, 1.5]), frequency_penalty=0.3)
    elif kind < 0.5:
        del common["temperature"]
    elif kind < 0.55:  # logit edits: a bias, and stop tokens masked until min_tokens
        common.update(logit_bias={str(rng.randrange(1000)): rng.choice([-100, 5])})
        common.update(min_tokens=rng.randint(1, max_tokens))
    if rng.random() < 0.2:
        common["seed"] = rng.randrange(2**31)
    if rng.random() < 0.08:
        common.update(rng.choice(CONSTRAINTS))
    if rng.random() < 0.1:
        common.update(rng.choice(EXTENSIONS))
    if stream and rng.random() < 0.5:
        common["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": rng.choice(PROMPTS), **common}
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.5:
        # A reasoning model's chat constraint holds after its </think>; without thinking,
        # from the first token.
        common["chat_template_kwargs"] = {"enable_thinking": False}
    if rng.random() < 0.1:  # rendered by templates that take tools, refused by the others
        common["tools"] = [WEATHER_TOOL]
        if rng.random() < 0.3 and not any(key in common for key in _CONSTRAINT_FIELDS):
            common["tool_choice"] = rng.choice(["required", NAMED_WEATHER])
    return "/v1/chat/completions", {"messages": messages, **common}


def client_loop(
    host: str, port: int, deadline: float, seed: int, counters: Counters, api_key: str | None
) -> None:
    rng = random.Random(seed)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    while time.monotonic() < deadline:
        path, body = _request_body(rng)
        cancel_after = rng.randint(1, 5) if body.get("stream") and rng.random() < 0.2 else None
        conn = http.client.HTTPConnection(host, port, timeout=300)
        try:
            conn.request("POST", path, json.dumps(body), headers)
            response = conn.getresponse()
            if response.status != 200:
                counters.add_status(response.status, response.read())
                if response.status == 503:
                    time.sleep(1.0)
                continue
            if not body.get("stream"):
                usage = json.loads(response.read()).get("usage") or {}
                counters.add("ok", usage.get("completion_tokens", 0))
                continue
            events = 0
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                events += 1
                if cancel_after is not None and events >= cancel_after:
                    counters.add("cancelled")
                    break
                if b'"error"' in line[:20]:
                    counters.add("failed", error=line[:200].decode(errors="replace"))
                    break
                if line.strip() == b"data: [DONE]":
                    counters.add("ok", max(events - 2, 0))
                    break
        except (OSError, http.client.HTTPException) as exc:
            counters.add("failed", error=repr(exc))
            time.sleep(0.5)
        finally:
            conn.close()


def fill_kv_cache(host: str, port: int, total_tokens: int, api_key: str | None) -> None:
    """Prefill distinct long prompts (no prefix-cache hits) until about ``total_tokens``
    KV slots have been written once."""
    rng = random.Random(0)
    words = ["alpha", "river", "stone", "cloud", "seven", "green", "north", "quiet", "ember"]
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    sent = 0
    while sent < total_tokens:
        count = min(400, total_tokens - sent)
        # About three tokens a word; at least one word, or the last few tokens would be an
        # empty prompt.
        words_needed = max(1, count // 3)
        prompt = " ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(words_needed))
        body = json.dumps({"prompt": prompt, "max_tokens": 1})
        conn = http.client.HTTPConnection(host, port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", body, headers)
            response = conn.getresponse()
            payload = json.loads(response.read() or b"{}")
            if response.status != 200:
                print(f"fill request refused ({response.status}): {payload}", flush=True)
                return
            sent += payload["usage"]["prompt_tokens"]
        finally:
            conn.close()
    print(f"filled the KV cache with {sent} prompt tokens", flush=True)


def tree_processes(launcher_pid: int) -> list[psutil.Process]:
    launcher = psutil.Process(launcher_pid)
    return [launcher, *launcher.children(recursive=True)]


def sample_rss(launcher_pid: int) -> dict[str, int]:
    """RSS in bytes of every process of the tree, by its title."""
    sizes: dict[str, int] = {}
    for proc in tree_processes(launcher_pid):
        try:
            title = " ".join(proc.cmdline()).split()[0] if proc.cmdline() else proc.name()
            sizes[f"{title}[{proc.pid}]"] = proc.memory_info().rss
        except psutil.Error:
            continue
    return sizes


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mean_t) * (v - mean_v) for t, v in points)
    return cov / var * 60.0


def start_server(args: argparse.Namespace, log_path: str) -> tuple[subprocess.Popen, str]:
    port = args.port
    server_args = args.server_args or list(DEFAULT_SERVER_ARGS)
    cmd = [sys.executable, "-m", "pegainfer.cli", "--port", str(port), *server_args]
    if args.model_path:
        cmd += ["--model-path", args.model_path]
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server did not become ready; see {log_path}")


def stop_server(proc: subprocess.Popen) -> list[str]:
    """SIGTERM to the launcher, as a user's Ctrl-C or a service manager sends it; the tree's
    processes that still run ``EXIT_GRACE_S`` after the launcher has gone."""
    try:
        tree = tree_processes(proc.pid)[1:]
    except psutil.Error:
        tree = []
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=EXIT_GRACE_S)
    left = []
    for child in alive:
        try:
            left.append(f"{child.name()}[{child.pid}]")
            child.kill()
        except psutil.Error:
            continue
    return left


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds not judged")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--port", type=int, default=18300)
    parser.add_argument("--url", default=None, help="use a running server instead")
    parser.add_argument("--launcher-pid", type=int, default=None, help="with --url")
    parser.add_argument("--api-key", default=None)
    parser.add_argument(
        "--max-growth-mb-per-min",
        type=float,
        default=2.0,
        help="after warm-up, a steeper RSS slope than this counts as growth",
    )
    parser.add_argument(
        "--fill-kv-tokens",
        type=int,
        default=2000,
        help="prefill this many distinct prompt tokens first, touching every KV block",
    )
    parser.add_argument("--json", default=None, help="write the samples and verdict here")
    parser.add_argument("server_args", nargs="*", help="extra arguments for pegainfer")
    args = parser.parse_args(argv)

    proc = None
    if args.url:
        if args.launcher_pid is None:
            raise SystemExit("--url needs --launcher-pid to find the tree's processes")
        url, launcher_pid = args.url.rstrip("/"), args.launcher_pid
    else:
        log_path = os.path.join(tempfile.gettempdir(), f"pegainfer-soak-{os.getpid()}.log")
        print(f"starting pegainfer (log: {log_path})", flush=True)
        proc, url = start_server(args, log_path)
        launcher_pid = proc.pid
    host, port = url.split("//", 1)[1].split(":")
    if args.fill_kv_tokens > 0:
        fill_kv_cache(host, int(port), args.fill_kv_tokens, args.api_key)
    counters = Counters()
    started = time.monotonic()
    deadline = started + args.duration
    clients = [
        threading.Thread(
            target=client_loop,
            args=(host, int(port), deadline, seed, counters, args.api_key),
            daemon=True,
        )
        for seed in range(args.concurrency)
    ]
    for thread in clients:
        thread.start()

    orphans: list[str] = []
    samples: list[tuple[float, int]] = []
    per_process_first: dict[str, int] = {}
    per_process_last: dict[str, int] = {}
    try:
        while time.monotonic() < deadline:
            now = time.monotonic() - started
            sizes = sample_rss(launcher_pid)
            total = sum(sizes.values())
            samples.append((now, total))
            if now >= args.warmup:
                for name, size in sizes.items():
                    per_process_first.setdefault(name, size)
                    per_process_last[name] = size
            print(
                f"{now:7.1f}s  tree RSS {total / 2**20:8.1f} MiB  ok {counters.ok} "
                f"refused {counters.refused} cancelled {counters.cancelled} "
                f"failed {counters.failed} tokens {counters.tokens}",
                flush=True,
            )
            time.sleep(args.interval)
        # A request still open this long after the deadline is hung: the mix's longest takes
        # seconds, and a client starts no new one past the deadline.
        join_deadline = time.monotonic() + HANG_AFTER_S
        for thread in clients:
            thread.join(timeout=max(0.0, join_deadline - time.monotonic()))
        hung = sum(thread.is_alive() for thread in clients)
        for _ in range(hung):
            counters.add("failed", error=f"a request still open {HANG_AFTER_S:.0f} s past the end")
    finally:
        orphans = stop_server(proc) if proc is not None else []

    judged = [(t, size / 2**20) for t, size in samples if t >= args.warmup]
    slope = slope_per_minute(judged)
    growth = judged[-1][1] - judged[0][1] if len(judged) >= 2 else 0.0
    grows = slope > args.max_growth_mb_per_min
    print("\nper process after warm-up (MiB): first -> last")
    for name in sorted(per_process_last):
        first, last = per_process_first[name] / 2**20, per_process_last[name] / 2**20
        print(f"  {name:<40} {first:8.1f} -> {last:8.1f} ({last - first:+.1f})")
    verdict = {
        "duration_s": round(time.monotonic() - started, 1),
        "warmup_s": args.warmup,
        "requests_ok": counters.ok,
        "requests_refused": counters.refused,
        "requests_cancelled": counters.cancelled,
        "requests_failed": counters.failed,
        "completion_tokens": counters.tokens,
        "statuses_not_200": {str(k): v for k, v in sorted(counters.statuses.items())},
        "processes_left_after_sigterm": orphans,
        "rss_after_warmup_mib": round(judged[0][1], 1) if judged else None,
        "rss_end_mib": round(judged[-1][1], 1) if judged else None,
        "growth_mib": round(growth, 1),
        "slope_mib_per_min": round(slope, 3),
        "grows": grows,
        "errors": counters.errors,
    }
    print(json.dumps(verdict, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"verdict": verdict, "samples": samples}, f)
    if counters.failed:
        print("FAIL: some requests failed", file=sys.stderr)
        return 1
    if orphans:
        print(f"FAIL: {', '.join(orphans)} still ran after the launcher exited", file=sys.stderr)
        return 1
    if grows:
        print("FAIL: resident memory grows after warm-up", file=sys.stderr)
        return 1
    print("OK: resident memory is flat after warm-up")
    return 0


if __name__ == "__main__":
    sys.exit(main())
