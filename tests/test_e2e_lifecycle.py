"""Starting and stopping the real process tree: signals, dead children, nothing left behind."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow

ROLES = ["worker-0", "scheduler", "detokenizer", "tokenizer-0", "frontend"]


def _start(model_dir: str, tmp_path) -> Server:
    return Server(
        "--model-path",
        model_dir,
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()


def test_every_process_names_itself(tiny_qwen3_dir, tmp_path):
    server = _start(tiny_qwen3_dir, tmp_path)
    try:
        titles = set(server.children())
        for role in ROLES:
            assert f"pegainfer::{role}" in titles, titles
        log = server.log()
        for role in ROLES:
            pid = server.children()[f"pegainfer::{role}"].pid
            assert re.search(rf"pegainfer::{role}\[{pid}\]", log), (role, log[-2000:])
        # Once ready, each process takes its start-up heap out of the collector's walks.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            log = server.log()
            if all(f"{role}: froze" in log for role in ROLES):
                break
            time.sleep(0.1)
        for role in ROLES:
            pid = server.children()[f"pegainfer::{role}"].pid
            assert re.search(
                rf"pegainfer::{role}\[{pid}\] \S+: {role}: froze \d{{4,}} objects of start-up", log
            ), (role, log[-3000:])
        # The worker imported torch with the collector off, and says what start-up collected.
        assert "worker-0: garbage collections during start-up, after its imports: " in log
        assert server.run_dir and os.path.isdir(server.run_dir)
        assert os.stat(server.run_dir).st_mode & 0o777 == 0o700
        manifest = os.path.join(server.run_dir, "manifest.json")
        assert os.path.isfile(manifest)
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_the_whole_tree(tiny_qwen3_dir, tmp_path, sig):
    server = _start(tiny_qwen3_dir, tmp_path)
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3})[0] == 200
    started = time.monotonic()
    code = server.stop(sig, timeout=15)
    assert code == 0, server.log()[-2000:]
    assert time.monotonic() - started < 10
    assert server.leftovers() == []


@pytest.mark.parametrize("role", ROLES)
def test_killed_child_brings_the_tree_down(tiny_qwen3_dir, tmp_path, role):
    server = _start(tiny_qwen3_dir, tmp_path)
    victim = server.children()[f"pegainfer::{role}"]
    victim.send_signal(signal.SIGKILL)
    try:
        code = server.proc.wait(timeout=15)
    except Exception:
        server.stop()
        raise
    server.log_file.close()
    assert code != 0
    log = server.log()
    assert f"pegainfer::{role} (pid {victim.pid}) was killed by signal SIGKILL" in log, log[-2000:]
    assert server.leftovers() == []


def test_stop_while_starting(tiny_qwen3_dir, tmp_path):
    """Every process is spawned at once; the scheduler and the frontend wait for the workers
    (their start stage in config.json). A SIGTERM in the middle of that stops them all."""
    import psutil

    server = Server(
        "--model-path",
        tiny_qwen3_dir,
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "512",
        log_path=str(tmp_path / "pegainfer.log"),
    )
    launcher = psutil.Process(server.proc.pid)
    deadline = time.monotonic() + 60
    while len(launcher.children()) < len(ROLES) and time.monotonic() < deadline:
        time.sleep(0.02)
    server.tree_pids = [p.pid for p in launcher.children(recursive=True)]
    assert len(server.tree_pids) >= len(ROLES), server.log()[-2000:]
    assert server.stop(signal.SIGTERM, timeout=20) == 0, server.log()[-2000:]
    assert server.leftovers() == []


def test_frontend_serves_only_once_the_tree_is_up(tiny_qwen3_dir, tmp_path):
    server = _start(tiny_qwen3_dir, tmp_path)
    try:
        log = server.log()
        order = [
            log.index("worker-0 ready (pid"),
            log.index("scheduler ready (pid"),
            log.index("pegainfer::frontend["),
        ]
        assert order == sorted(order), log[-3000:]
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []


def test_a_first_start_fills_the_bytecode_cache_beside_the_tree_and_leaves_nothing(
    tiny_qwen3_dir, tmp_path
):
    """Where bytecode may not be written, the first start fills pegainfer's bytecode cache on
    processes beside the tree's (two here, by the setting), stops them with the tree, and a
    start after a finished filling runs none."""
    from pegainfer.bytecode_warm import marker

    cache = tmp_path / "cache"
    env = {
        "PYTHONDONTWRITEBYTECODE": "1",
        "PEGAINFER_CACHE": str(cache),
        "PEGAINFER_BYTECODE_FILL": "2",
    }
    args = ("--model-path", tiny_qwen3_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "512")
    server = Server(*args, log_path=str(tmp_path / "first.log"), env=env).wait_ready()
    try:
        log = server.log()
        found = re.search(r"filling it with the workers' imports on 2 processes \(pid (\d+)\)", log)
        assert found, log[-3000:]
        # The launcher notes the filling once the frontend's ready message reaches it, which
        # may be just after the port answers.
        deadline = time.monotonic() + 30
        while "bytecode cache: " not in log and time.monotonic() < deadline:
            time.sleep(0.1)
            log = server.log()
        assert "bytecode cache: " in log, log[-3000:]
        done = marker(str(cache / "bytecode"))
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert os.path.exists(done)
    finally:
        assert server.stop() == 0
    assert server.leftovers() == []

    again = Server(*args, log_path=str(tmp_path / "again.log"), env=env).wait_ready()
    try:
        log = again.log()
        assert "keep their bytecode in" in log and "filling it" not in log, log[-3000:]
    finally:
        assert again.stop() == 0
    assert again.leftovers() == []
