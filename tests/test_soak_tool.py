"""tools/soak.py's request mix, its KV-cache fill and how it counts answers, against a
stand-in HTTP server; the processes a stopped tree leaves behind."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil

from tools import soak, soak_mix


class _Completions(BaseHTTPRequestHandler):
    """Counts three prompt tokens a word and refuses an empty prompt, as the server does."""

    prompts: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        self.prompts.append(prompt)
        tokens = 3 * len(prompt.split())
        status, payload = 200, {"usage": {"prompt_tokens": tokens}}
        if tokens == 0:
            status, payload = 400, {"error": {"message": "the prompt is empty"}}
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # noqa: ANN002 - silence the per-request lines
        pass


def test_the_fill_sends_no_empty_prompt_and_reaches_its_total(capsys):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    _Completions.prompts = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        # 2,000 tokens: five prompts of 399, then 5 left, then 2 (fewer than a word's 3).
        soak.fill_kv_cache("127.0.0.1", server.server_address[1], 2000, None)
    finally:
        server.shutdown()
    out = capsys.readouterr().out
    assert "refused" not in out
    assert "filled the KV cache with 2001 prompt tokens" in out
    assert all(prompt.strip() for prompt in _Completions.prompts)


def test_the_mix_takes_every_sampling_path_and_some_invalid_requests():
    rng = random.Random(0)
    drawn = [soak_mix.request_body(rng) for _ in range(2000)]
    bodies = [body for _, body in drawn]
    responses = [body for path, body in drawn if path == "/v1/responses"]
    assert len(responses) > 40 and all("input" in body for body in responses)
    invalid = [b for b in bodies if b.get("max_tokens") == -1]
    valid = [b for b in bodies if b.get("max_tokens") != -1]
    assert 40 < len(invalid) < 160
    defaults = [b for b in valid if "temperature" not in b]
    candidates = [b for b in valid if b.get("top_k") == 20]
    penalised = [b for b in valid if "presence_penalty" in b]
    seeded = [b for b in valid if "seed" in b]
    edited = [b for b in valid if "logit_bias" in b and "min_tokens" in b]
    tools = [b for b in valid if "tools" in b]
    constrained = [b for b in valid if set(soak_mix.CONSTRAINT_FIELDS) & set(b)]
    forced = [b for b in valid if "tool_choice" in b]
    for share in (defaults, candidates, penalised, seeded, edited, tools, constrained):
        assert len(share) > 40
    assert len(forced) > 10
    assert any(b.get("guided_regex") == soak_mix.BROKEN_REGEX for b in constrained)
    refusable = [b for b in bodies if soak_mix.may_be_refused(b)]
    assert {id(b) for b in invalid} <= {id(b) for b in refusable}
    assert {id(b) for b in tools} <= {id(b) for b in refusable}
    # Most of the mix is meant to be served: a 4xx to it fails the soak.
    assert len(refusable) < len(bodies) * 0.2
    assert all(b["min_tokens"] <= b["max_tokens"] for b in edited)
    assert not any("top_k" in b or "presence_penalty" in b for b in defaults)


class _Answers(BaseHTTPRequestHandler):
    """Answers every request with ``status`` and a short JSON error."""

    status = 500

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        data = json.dumps({"error": {"message": f"status {self.status}"}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # noqa: ANN002 - silence the per-request lines
        pass


def _run_clients_against(status: int) -> soak_mix.Counters:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    _Answers.status = status
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    counters = soak_mix.Counters()
    try:
        soak_mix.client_loop(
            "127.0.0.1", server.server_address[1], time.monotonic() + 0.3, 0, counters, None
        )
    finally:
        server.shutdown()
    return counters


def test_a_server_error_counts_as_failed_and_a_client_error_as_refused():
    broken = _run_clients_against(500)
    assert broken.failed > 0 and broken.refused == 0 and broken.ok == 0
    assert broken.statuses == {500: broken.failed}
    assert broken.errors[0].startswith("HTTP 500: ")
    refused = _run_clients_against(400)
    assert refused.refused > 0 and refused.failed == 0
    assert refused.statuses == {400: refused.refused}
    assert refused.refusals == {"400: status 400": refused.refused}
    # Most of the mix is meant to be served: those 400s are unexpected as well.
    assert refused.refused > refused.unexpected > 0
    assert refused.errors[0] == "unexpected refusal 400: status 400"
    overloaded = _run_clients_against(503)
    assert overloaded.refused > 0 and overloaded.unexpected == 0 and not overloaded.errors


def test_refusals_keep_each_message_up_to_a_limit():
    counters = soak_mix.Counters()
    counters.add_status(400, b'{"error": {"message": "max_tokens must be at least 1"}}')
    counters.add_status(400, b'{"error": {"message": "max_tokens must be at least 1"}}')
    counters.add_status(503, b"not json")
    for n in range(2 * soak_mix.MAX_REFUSAL_REASONS):
        counters.add_status(400, json.dumps({"error": {"message": f"value {n}"}}).encode())
    assert counters.refused == 3 + 2 * soak_mix.MAX_REFUSAL_REASONS
    assert len(counters.refusals) == soak_mix.MAX_REFUSAL_REASONS
    assert counters.refusals["400: max_tokens must be at least 1"] == 2
    assert counters.refusals["503: not json"] == 1
    assert counters.unexpected == 0
    counters.add_status(400, b'{"error": {"message": "no xgrammar"}}', refusable=False)
    counters.add_status(503, b"busy", refusable=False)  # overload is never unexpected
    assert counters.unexpected == 1 and counters.errors == ["unexpected refusal 400: no xgrammar"]


_LAUNCHER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
def stop(*_):
    if sys.argv[2] == "reap":
        child.terminate()
        child.wait()
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
time.sleep(60)
"""
_STUBBORN_CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
)


def _launch(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LAUNCHER,
            _STUBBORN_CHILD if mode == "leave" else "import time; time.sleep(60)",
            mode,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def test_stopping_the_server_names_the_processes_it_left_behind(monkeypatch):
    monkeypatch.setattr(soak, "EXIT_GRACE_S", 1.0)
    assert soak.stop_server(_launch("reap")) == []
    left = soak.stop_server(_launch("leave"))
    assert len(left) == 1 and left[0].startswith("python")


_METRICS = """# HELP pegainfer:num_requests_running Requests running on the engine.
# TYPE pegainfer:num_requests_running gauge
pegainfer:num_requests_running{model_name="m"} %d
pegainfer:num_requests_waiting{model_name="m"} 0
pegainfer:num_requests_in_flight{model_name="m"} 0
pegainfer:num_preemptions_total{model_name="m"} 7
pegainfer:request_success_total{model_name="m",finished_reason="length"} 40
pegainfer:request_success_total{model_name="m",finished_reason="stop"} 2
pegainfer:time_to_first_token_seconds_bucket{model_name="m",le="0.1"} 3
pegainfer:time_to_first_token_seconds_count{model_name="m"} 3
"""


class _Metrics(BaseHTTPRequestHandler):
    """/metrics whose running gauge counts down to 0 over ``running`` reads."""

    running = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        data = (_METRICS % max(_Metrics.running, 0)).encode()
        _Metrics.running -= 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # noqa: ANN002 - silence the per-request lines
        pass


def test_the_engine_counts_once_every_client_is_done():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    try:
        _Metrics.running = 2  # two reads still show a request running, the third none
        samples = soak.wait_for_idle_engine("127.0.0.1", port, None, timeout=10)
        assert _Metrics.running == -1
        assert samples["num_requests_running"] == 0
        assert samples["num_preemptions_total"] == 7
        assert samples["request_success_total[length]"] == 40
        assert samples["request_success_total[stop]"] == 2
        assert not any("bucket" in name or "_count" in name for name in samples)
        _Metrics.running = 100  # never idle: the samples as they stand at the timeout
        stuck = soak.wait_for_idle_engine("127.0.0.1", port, None, timeout=0.5)
        assert stuck["num_requests_running"] > 0
    finally:
        server.shutdown()


def test_processes_are_named_by_title_or_by_module():
    assert soak.process_title(["pegainfer::worker-0"], "python3") == "pegainfer::worker-0"
    run_dir = ["--run-dir", "/tmp/r"]
    python = "/opt/venv/bin/python3"
    assert soak.process_title([python, "-m", "scheduler_proc", *run_dir], "python3") == (
        "-m scheduler_proc"
    )
    assert soak.process_title([python, "-c", "pass"], "python3") == python
    assert soak.process_title([], "python3") == "python3"
