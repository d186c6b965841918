"""`pegainfer tap`: the per-process tap sockets never block the sender, and the tool shows
a live tree's messages; a second tokenizer started by hand joins a running tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from pegainfer import ipc, protocol, tap
from tests.server_util import Server

REPO_ROOT = str(Path(__file__).resolve().parent.parent)


@pytest.fixture
def tapped_process(tmp_path):
    run_dir = str(tmp_path)
    ipc.enable_tap(run_dir, "proc-a")
    ctx = zmq.Context()
    try:
        yield run_dir, ctx
    finally:
        ipc.disable_tap()
        ctx.destroy(linger=0)


def test_sent_messages_are_mirrored_with_their_route(tapped_process):
    run_dir, ctx = tapped_process
    inbound = ipc.bind(ctx, zmq.PULL, run_dir, "scheduler")
    outbound = ipc.connect(ctx, zmq.PUSH, run_dir, "scheduler")
    sub = ctx.socket(zmq.SUB)
    sub.connect(tap.tap_sockets(run_dir)["proc-a"])
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.2)  # a SUB sees only what is published after it joined
    ipc.send(outbound, protocol.AbortRequests(["r1", "r2"]))
    assert ipc.recv(inbound, None, "test", timeout_ms=2000).request_ids == ["r1", "r2"]
    assert sub.poll(2000)
    topic, data = sub.recv_multipart()
    assert topic == b"proc-a>scheduler"
    source, destination, kind, line = tap.format_line(topic, data, time.monotonic())
    assert (source, destination, kind) == ("proc-a", "scheduler", "AbortRequests")
    assert "requests=r1,r2" in line


def test_a_tap_nobody_reads_never_blocks_the_sender(tapped_process):
    run_dir, ctx = tapped_process
    inbound = ipc.bind(ctx, zmq.PULL, run_dir, "detokenizer")
    outbound = ipc.connect(ctx, zmq.PUSH, run_dir, "detokenizer")
    stalled = ctx.socket(zmq.SUB)  # subscribed but never reading: the tap drops for it
    stalled.setsockopt(zmq.RCVHWM, 10)
    stalled.connect(tap.tap_sockets(run_dir)["proc-a"])
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.1)
    message = protocol.TokenOutputs([])
    count = 3 * ipc.TAP_HWM
    started = time.monotonic()
    for _ in range(count):
        ipc.send(outbound, message)
    assert time.monotonic() - started < 10.0
    received = 0
    while ipc.recv(inbound, None, "test", timeout_ms=1000) is not None:
        received += 1
        if received == count:
            break
    assert received == count  # the real traffic is untouched


def test_summaries_of_the_hot_messages():
    plan = protocol.StepPlan(
        7, [], protocol.pack_ids([1, 2]), protocol.pack_ids([0, 4]),
        protocol.pack_ids([4, 1]), [], b"",
    )  # fmt: skip
    assert tap.summarize(plan) == "step=7 batch=2 tokens=5 new=0 finished=0"
    result = protocol.StepResult(7, protocol.pack_ids([1]), protocol.pack_ids([9]))
    assert tap.summarize(result) == "step=7 sampled=1"
    _, _, kind, line = tap.format_line(b"a>b", b"\x93junk", 0.0)
    assert kind == "?" and "undecodable" in line


# -- against a live tree ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tap") / "pegainfer.log"
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "256",
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pegainfer.cli", "tap", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


@pytest.mark.slow
def test_tap_lists_and_shows_live_messages(server):
    listing = run_cli(server.run_dir, "--list")
    assert listing.returncode == 0, listing.stderr
    for name in ("pegainfer::scheduler", "pegainfer::worker-0", "tap-{process}", "frontend"):
        assert name in listing.stdout
    everyone = run_cli("--list")
    assert server.run_dir in everyone.stdout

    watcher = subprocess.Popen(
        [sys.executable, "-m", "pegainfer.cli", "tap", server.run_dir, "--json",
         "--to", "worker-0", "--to", "frontend", "--duration", "30", "--count", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
    )  # fmt: skip
    try:
        time.sleep(2.0)  # let it subscribe
        status, _ = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert status == 200
        out, err = watcher.communicate(timeout=60)
    finally:
        watcher.kill()
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 6, (out, err)
    assert {line["to"] for line in lines} <= {"worker-0", "frontend"}
    kinds = {(line["from"], line["type"]) for line in lines}
    assert ("scheduler", "StepPlan") in kinds
    assert any(kind in ("TextOutputs", "EngineStats") for _, kind in kinds)


@pytest.mark.slow
def test_a_second_tokenizer_started_by_hand_serves_requests(server):
    env = {k: v for k, v in os.environ.items() if k != "PEGAINFER_PARENT_PID"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "frontend_proc.tokenizer_proc", "--run-dir", server.run_dir,
         "--index", "1"],
        env={**env, "PYTHONPATH": REPO_ROOT}, cwd=REPO_ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(server.run_dir, "tap-tokenizer-1.sock")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(1.0)  # ready and connected
        for i in range(6):  # round-robin: both tokenizers get some
            status, body = server.post("/v1/completions", {"prompt": f"n{i}", "max_tokens": 2})
            assert status == 200, body
    finally:
        proc.terminate()
        output = proc.communicate(timeout=20)[0]
    assert "pegainfer::tokenizer-1" in output
