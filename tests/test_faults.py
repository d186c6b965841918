"""Faults on the real process tree: a child killed mid-stream, SIGTERM draining, a storm of
clients that disconnect, and a stalled step caught by the watchdog. After each: clients got
an answer (never a hang), and no process or run directory is left behind."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.request

import openai
import psutil
import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow

ROLES = ["worker-0", "scheduler", "detokenizer", "tokenizer-0", "frontend"]
LONG = {"max_tokens": 400, "ignore_eos": True}


def start(model_dir: str, tmp_path, *extra: str) -> Server:
    return Server(
        "--model-path", model_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "512",
        *extra, log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip


class Stream(threading.Thread):
    """A streaming completion read to its end; records the chunks, the finish reason and
    how it ended."""

    def __init__(self, server: Server, prompt: str = "Go on", **body) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(
            base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=60
        )
        self.body = {"model": "m", "prompt": prompt, **body}
        self.first_chunk = threading.Event()
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        extra = {k: v for k, v in self.body.items() if k == "ignore_eos"}
        body = {k: v for k, v in self.body.items() if k != "ignore_eos"}
        try:
            model = self.client.models.list().data[0].id
            body["model"] = model
            for chunk in self.client.completions.create(stream=True, extra_body=extra, **body):
                self.first_chunk.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
        except BaseException as exc:  # noqa: BLE001 - recorded for the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()


def post(server: Server, body: dict, timeout: float = 60) -> tuple[int | None, dict]:
    try:
        return server.post("/v1/completions", body, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - a dead frontend drops the connection
        return None, {"exception": repr(exc)}


@pytest.mark.parametrize("role", ROLES)
def test_killed_child_fails_requests_at_once(tiny_qwen3_dir, tmp_path, role):
    server = start(tiny_qwen3_dir, tmp_path)
    try:
        stream = Stream(server, **LONG)
        assert stream.first_chunk.wait(60), server.log()[-2000:]
        plain: dict = {}
        plain_thread = threading.Thread(
            target=lambda: plain.update(result=post(server, {"prompt": "Hi", **LONG})),
            daemon=True,
        )
        plain_thread.start()
        time.sleep(0.5)
        victim = server.children()[f"pegainfer::{role}"]
        killed_at = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        stream.join(15)
        plain_thread.join(15)
        assert not stream.is_alive() and not plain_thread.is_alive(), "a client hung"
        assert stream.error is not None and stream.finish_reason is None
        assert stream.ended_at - killed_at < 5.0
        status, body = plain["result"]
        if role == "frontend":
            assert status is None  # the connection itself is gone
        else:
            assert status == 503, body
            assert f"pegainfer::{role}" in body["error"]["message"]
            assert isinstance(stream.error, openai.APIError), repr(stream.error)
        code = server.proc.wait(timeout=20)
    finally:
        server.stop()
    assert code != 0
    assert f"pegainfer::{role} (pid {victim.pid}) was killed by signal SIGKILL" in server.log()
    assert server.leftovers() == []


def scrape(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as resp:
        text = resp.read().decode()
    return {
        line.rsplit(" ", 1)[0].split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def idle(sample: dict[str, float]) -> bool:
    return (
        sample["pegainfer:num_requests_running"] == 0
        and sample["pegainfer:num_requests_waiting"] == 0
        and sample["pegainfer:kv_cache_usage_perc"] == 0
        and sample["pegainfer:num_requests_in_flight"] == 0
    )


def disconnecting_client(port: int, stream: bool, started: threading.Barrier) -> None:
    body = json.dumps({"prompt": "storm", "stream": stream, **LONG})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        started.wait(30)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        if stream:
            response = conn.getresponse()
            response.fp.readline()  # the first event's line, then gone
        else:
            time.sleep(0.5)  # gone before the answer
    finally:
        conn.sock and conn.sock.close()
        conn.close()


def test_disconnect_storm_then_sigterm_drain(tiny_qwen3_dir, tmp_path):
    # Room for a request that cannot finish within the drain on any machine (4,000 tokens in
    # 2 s); with 400 tokens a fast CPU finished it before the drain ended.
    server = start(tiny_qwen3_dir, tmp_path, "--shutdown-timeout", "2", "--max-model-len", "4096")
    try:
        # -- 100 clients that go away mid-request: everything they held is released.
        barrier = threading.Barrier(100)
        clients = [
            threading.Thread(target=disconnecting_client, args=(server.port, i % 2 == 0, barrier))
            for i in range(100)
        ]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(60)
        gone_at = time.monotonic()
        sample = scrape(server)
        while not idle(sample) and time.monotonic() - gone_at < 10:
            time.sleep(0.1)
            sample = scrape(server)
        assert idle(sample), sample
        assert time.monotonic() - gone_at < 3.0, "metrics took too long to return to idle"
        assert server.post("/v1/completions", {"prompt": "after", "max_tokens": 2})[0] == 200

        # -- SIGTERM: in-flight requests drain, new ones are refused, the rest are aborted.
        long = Stream(server, prompt="long", max_tokens=4000, ignore_eos=True)
        assert long.first_chunk.wait(60)
        short = Stream(server, prompt="short", max_tokens=8, ignore_eos=True)
        assert short.first_chunk.wait(60)
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        status, body = server.get("/health")
        assert status == 503
        status, body = post(server, {"prompt": "late", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == "server_draining", body
        short.join(30)
        long.join(30)
        assert short.error is None and short.finish_reason == "length"
        assert long.error is None and long.finish_reason == "abort"
        assert 1.5 <= long.ended_at - signalled < 7.0
        code = server.proc.wait(timeout=20)
        assert code == 0, server.log()[-3000:]
    finally:
        server.stop()
    assert "drained: " in server.log()
    assert server.leftovers() == []


def test_watchdog_dumps_every_stack_and_stops_the_tree(tiny_qwen3_dir, tmp_path):
    server = start(tiny_qwen3_dir, tmp_path, "--watchdog-timeout", "2")
    try:
        stream = Stream(server, **LONG)
        assert stream.first_chunk.wait(60)
        worker = server.children()["pegainfer::worker-0"]
        worker.send_signal(signal.SIGSTOP)  # a step that never finishes
        code = server.proc.wait(timeout=30)
        stream.join(15)
    finally:
        try:
            worker.send_signal(signal.SIGCONT)
        except psutil.Error:
            pass
        server.stop()
    log = server.log()
    assert code != 0
    assert "watchdog: step" in log
    # faulthandler's dumps: every live process writes its threads' stacks.
    assert log.count("most recent call first") >= len(ROLES), log[-4000:]
    assert "scheduler_proc" in log.split("watchdog: step", 1)[1]
    assert stream.error is not None
    assert server.leftovers() == []
