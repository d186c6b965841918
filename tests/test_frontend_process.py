"""The frontend and a tokenizer as real processes, with a stand-in for the scheduler and
detokenizer, driven by the openai client: the processes start, report ready, serve (the
frontend's /tokenize through the tokenizer: it loads none itself), and abort what a
vanished client left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import zmq

from pegainfer import ipc
from pegainfer.config import EngineConfig, ModelInfo
from pegainfer.protocol import (
    AbortRequests,
    ProcessReady,
    TextDelta,
    TextOutputs,
    TokenizedRequest,
    unpack_ids,
)
from tests.test_tokenizer_proc import WORDS, write_model_dir

openai = pytest.importorskip("openai")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


THINKING_MAX_TOKENS = 7  # the stand-in answers these requests with a <think> block


class StandInEngine(threading.Thread):
    """Answers every request "hello world" in two steps; records aborts."""

    def __init__(self, ctx: zmq.Context, run_dir: str) -> None:
        super().__init__(daemon=True)
        self.inbound = ipc.bind(ctx, zmq.PULL, run_dir, "scheduler")
        self.outbound = ipc.connect(ctx, zmq.PUSH, run_dir, "frontend")
        self.requests: list[TokenizedRequest] = []
        self.aborted: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            msg = ipc.recv(self.inbound, (TokenizedRequest, AbortRequests), "scheduler", 50)
            if isinstance(msg, AbortRequests):
                self.aborted.extend(msg.request_ids)
            elif isinstance(msg, TokenizedRequest):
                self.requests.append(msg)
                if msg.sampling.max_tokens == 1000:
                    continue  # a request that never finishes, for the abort test
                n = len(unpack_ids(msg.prompt_token_ids))
                rid = msg.request_id
                first, second = "hello", " world"
                if msg.sampling.max_tokens == THINKING_MAX_TOKENS:
                    first, second = "<think>plan</think>", "Paris"
                ipc.send(
                    self.outbound, TextOutputs([TextDelta(rid, first, b"", None, None, n, 1, 0)])
                )
                ipc.send(
                    self.outbound,
                    TextOutputs([TextDelta(rid, second, b"", "stop", None, n, 2, 0)]),
                )


def start(module: str, run_dir: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("PEGAINFER_PARENT_PID", None)
    return subprocess.Popen(
        [sys.executable, "-m", module, "--run-dir", run_dir, *extra], env=env, cwd=REPO_ROOT
    )


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_frontend_imports_no_tokenizer_library():
    code = (
        "import sys, frontend_proc.__main__; "
        "print(sorted(m for m in ('tokenizers', 'jinja2') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_frontend_and_tokenizer_processes(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    write_model_dir(model_dir)
    run_dir = tmp_path / "r"
    run_dir.mkdir(mode=0o700)
    config = EngineConfig(
        model_path=str(model_dir),
        served_model_name="tiny",
        port=0,
        max_model_len=1024,
        run_dir=str(run_dir),
        log_level="warning",
        model=ModelInfo("LlamaForCausalLM", len(WORDS), 1024, [2], 1, 1, 1, 8, 8),
        reasoning=True,  # as the launcher sets it when the tokenizer reports so
    )
    config.save(str(run_dir))
    ctx = zmq.Context()
    launcher = ipc.bind(ctx, zmq.PULL, str(run_dir), "launcher")
    engine = StandInEngine(ctx, str(run_dir))
    engine.start()
    procs = [start("frontend_proc.tokenizer_proc", str(run_dir), "--index", "0")]
    try:
        ready = ipc.recv(launcher, (ProcessReady,), "launcher", timeout_ms=30_000)
        assert ready is not None and ready.name == "tokenizer-0"
        procs.append(start("frontend_proc", str(run_dir)))
        ready = ipc.recv(launcher, (ProcessReady,), "launcher", timeout_ms=30_000)
        assert ready is not None and ready.name == "frontend"
        port = ready.info["port"]
        assert port > 0
        with open(f"/proc/{ready.pid}/maps") as f:
            assert "tokenizers" not in f.read()  # the frontend loaded no tokenizer

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]

        out = client.completions.create(model="tiny", prompt="hello the cat", max_tokens=5)
        assert out.choices[0].text == "hello world"
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.prompt_tokens == 4  # <s> hello the cat

        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}]
        )
        assert chat.choices[0].message.content == "hello world"
        # Chat without max_tokens fills the rest of the window.
        assert engine.requests[-1].sampling.max_tokens == 1024 - chat.usage.prompt_tokens

        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "hello world" and chunks[-1].usage.completion_tokens == 2

        thought = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=THINKING_MAX_TOKENS,
        )
        assert thought.choices[0].message.content == "Paris"
        assert thought.choices[0].message.reasoning_content == "plan"

        # /tokenize and /detokenize are answered by the tokenizer process.
        status, body = post(
            port, "/tokenize", {"prompt": "hello the cat", "return_token_strs": True}
        )
        assert status == 200 and body["tokens"] == [1, 5, 7, 8] and body["max_model_len"] == 1024
        assert body["token_strs"] == ["<s>", "hello", "the", "cat"] and body["count"] == 4
        chat = {"messages": [{"role": "user", "content": "hello"}], "add_generation_prompt": False}
        status, body = post(port, "/tokenize", chat)
        assert status == 200 and body["tokens"] == [1, 3, 5, 2]
        status, body = post(port, "/detokenize", {"tokens": [5, 6]})
        assert (status, body) == (200, {"prompt": "hello world"})
        for tokens in ([5, 999], [2**40]):
            status, body = post(port, "/detokenize", {"tokens": tokens})
            assert status == 400 and "out of vocabulary" in body["error"]["message"]

        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt=[5, 999], max_tokens=2)
        assert "out of vocabulary" in str(info.value)

        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="x")

        # A client that gives up: the frontend aborts its request in the engine.
        slow = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=0.5
        )
        with pytest.raises(openai.APITimeoutError):
            slow.completions.create(model="tiny", prompt="hello", max_tokens=1000)
        hung = engine.requests[-1].request_id
        deadline = time.time() + 5
        while hung not in engine.aborted and time.time() < deadline:
            time.sleep(0.02)
        assert engine.aborted == [hung]
        assert all(p.poll() is None for p in procs)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        engine.stop.set()
        engine.join(timeout=5)
        ctx.destroy(linger=0)
