"""Soak test: moderate load on a pegainfer tree for a long time, watching its memory.

Starts the server (the embedded default model unless ``--model-path``), or uses a running
one (``--url`` plus ``--launcher-pid``), runs ``--concurrency`` clients that send a mix of
streaming and non-streaming completions and chats (some cancelled halfway, some invalid),
and samples the resident memory of every process of the tree. After ``--warmup`` seconds it
fits a line through the tree's total RSS and reports whether memory grows: a leak shows up
as a steady slope, while allocator noise does not. It fails on any lost request as well: a
5xx other than 503, an error event in a stream, a broken connection, a request still open
two minutes after the load ends, or one the engine still holds (/metrics: running, waiting
or awaited by the frontend) once every client is done; and, when it started the server, on
any process of the tree still running 10 s after the launcher has exited on SIGTERM.
The verdict counts the refused requests (4xx, and 503 while overloaded) by status and the
error's message; a 4xx to a request the mix meant to be served (not invalid on purpose)
fails the run, as a request lost to the server's set-up.

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

import psutil

from tools.soak_mix import Counters, client_loop

DEFAULT_SERVER_ARGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "1024")
HANG_AFTER_S = 120.0
# The gauges that count requests inside the engine; all are 0 once every client is done.
ENGINE_HOLDS = ("num_requests_running", "num_requests_waiting", "num_requests_in_flight")
# The scheduler's gauges reach /metrics a few times a second.
IDLE_WAIT_S = 30.0
EXIT_GRACE_S = 10.0


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


def read_metrics(host: str, port: int, api_key: str | None) -> dict[str, float]:
    """The server's /metrics samples by name, summed over their labels, with the finished
    requests by reason (``request_success_total[stop]``) and no histogram series."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers)
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.removeprefix("pegainfer:").partition("{")
        if name.endswith(("_bucket", "_sum", "_count")):
            continue
        if name == "request_success_total":
            reason = labels.split('finished_reason="', 1)[-1].split('"', 1)[0]
            name = f"{name}[{reason}]"
        samples[name] = samples.get(name, 0.0) + float(value)
    return samples


def wait_for_idle_engine(
    host: str, port: int, api_key: str | None, timeout: float
) -> dict[str, float]:
    """/metrics once the engine holds no request (running, waiting, or awaited by the
    frontend), or as it stands after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        samples = read_metrics(host, port, api_key)
        held = sum(samples.get(gauge, 0.0) for gauge in ENGINE_HOLDS)
        if held == 0 or time.monotonic() >= deadline:
            return samples
        time.sleep(1.0)


def tree_processes(launcher_pid: int) -> list[psutil.Process]:
    launcher = psutil.Process(launcher_pid)
    return [launcher, *launcher.children(recursive=True)]


def sample_rss(launcher_pid: int) -> dict[str, int]:
    """RSS in bytes of every process of the tree, by its title."""
    sizes: dict[str, int] = {}
    for proc in tree_processes(launcher_pid):
        try:
            sizes[f"{process_title(proc.cmdline(), proc.name())}[{proc.pid}]"] = (
                proc.memory_info().rss
            )
        except psutil.Error:
            continue
    return sizes


def process_title(cmdline: list[str], name: str) -> str:
    """The title a pegainfer process gives itself (``pegainfer::scheduler``); where titles
    cannot be set (no setproctitle), the module it runs (``-m scheduler_proc``)."""
    if not cmdline:
        return name
    title = " ".join(cmdline).split()[0]
    if title.startswith("pegainfer::") or "-m" not in cmdline[:-1]:
        return title
    return "-m " + cmdline[cmdline.index("-m") + 1]


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
    server_after: dict[str, float] = {}
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
        # Every client is done (or counted hung): a request the engine still holds was lost
        # inside it, a cancelled stream's say.
        server_after = wait_for_idle_engine(host, int(port), args.api_key, IDLE_WAIT_S)
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
        "requests_refused_unexpectedly": counters.unexpected,
        "requests_cancelled": counters.cancelled,
        "requests_failed": counters.failed,
        "completion_tokens": counters.tokens,
        "statuses_not_200": {str(k): v for k, v in sorted(counters.statuses.items())},
        "refusals": dict(sorted(counters.refusals.items(), key=lambda item: -item[1])),
        "processes_left_after_sigterm": orphans,
        "server_after_load": server_after,
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
    if counters.unexpected:
        print(
            f"FAIL: {counters.unexpected} requests meant to be served were refused "
            "(the verdict's refusals say why)",
            file=sys.stderr,
        )
        return 1
    held = {gauge: server_after.get(gauge, 0.0) for gauge in ENGINE_HOLDS}
    if any(held.values()):
        print(f"FAIL: the engine still held requests after the load: {held}", file=sys.stderr)
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
