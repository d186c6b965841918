"""The OpenAI API of the real process tree serving the embedded default model, on CPU."""

from __future__ import annotations

import http.client
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from tokenizers import Tokenizer

from tests.server_util import Server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "pegainfer.log"
    # No --model-path: the default model, found in (or converted into) the cache directory.
    srv = Server(
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory",
        "256MiB",
        log_path=str(log),
        env={"PEGAINFER_CACHE": os.path.dirname(smollm2_dir)},
    ).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert srv.leftovers() == []


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def test_health_and_models(server):
    status, _ = server.get("/health")
    assert status == 200
    status, body = server.get("/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert body["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert body["data"][0]["object"] == "model"


def test_completion_says_paris_with_plain_http(server, tokenizer):
    prompt = "The capital of France is"
    status, body = server.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}
    )
    assert status == 200, body
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    assert body["model"] == "SmolLM2-135M-Instruct"
    choice = body["choices"][0]
    assert "Paris" in choice["text"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(prompt).ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == 8


def test_completion_with_openai_client(client, model_name, tokenizer):
    out = client.completions.create(
        model=model_name, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in out.choices[0].text
    assert out.usage.prompt_tokens == len(tokenizer.encode("The capital of France is").ids)


def test_chat_nonstreaming_and_streaming_agree(client, model_name):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=24, temperature=0
    )
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert "Paris" in text
    assert full.choices[0].finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert [f for f in finishes if f] == [full.choices[0].finish_reason]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_usage_counts_the_template(client, model_name, smollm2_dir):
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if hasattr(expected, "keys"):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    out = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=5, temperature=0
    )
    assert out.usage.prompt_tokens == len(expected)
    assert out.usage.completion_tokens <= 5
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_raw_sse_ends_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    events = [line for line in resp.read().decode().split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    conn.close()


def _complete(client, model_name, prompt: str, max_tokens: int) -> tuple[str, str]:
    out = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0
    )
    return out.choices[0].text, out.choices[0].finish_reason


def test_sixteen_concurrent_requests_match_sequential(client, model_name):
    subjects = ["France", "Japan", "Italy", "Spain", "Germany", "Canada", "Egypt", "Peru"]
    prompts = []
    for i in range(16):
        subject = subjects[i % len(subjects)]
        filler = " Please be precise." * (i % 5)
        prompts.append((f"Tell me about {subject}.{filler} Answer:", 4 + 3 * i))
    sequential = [_complete(client, model_name, p, n) for p, n in prompts]
    with ThreadPoolExecutor(16) as pool:
        concurrent = list(pool.map(lambda pn: _complete(client, model_name, *pn), prompts))
    assert concurrent == sequential
    assert len({text for text, _ in sequential}) > 4  # really different answers


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400),
    ("/v1/completions", {"prompt": 42}, 400),
    ("/v1/completions", {"max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400),
    ("/v1/chat/completions", {"max_tokens": 4}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        400,
    ),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"},
        404,
    ),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(server, path, body, status):
    got, payload = server.post(path, body)
    assert got == status, payload
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "param", "code"} <= set(error)
    ok, answer = server.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2})
    assert ok == 200, answer


def test_prompt_longer_than_context_is_400(server):
    prompt = "hello " * (MAX_MODEL_LEN + 50)
    status, payload = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 4})
    assert status == 400
    assert payload["error"]["code"] == "context_length_exceeded" or "context" in (
        payload["error"]["message"].lower()
    )
    status, payload = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4},
    )
    assert status == 400
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200


def test_disconnect_mid_stream_aborts_the_request(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "Once upon a time", "max_tokens": 900, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = resp.readline().decode()
    request_id = json.loads(first.removeprefix("data: "))["id"]
    conn.sock.close()
    conn.close()
    deadline = time.monotonic() + 30
    scheduler_lines: list[str] = []
    while time.monotonic() < deadline:
        scheduler_lines = [
            line
            for line in server.log().splitlines()
            if request_id in line and "pegainfer::scheduler" in line and "abort" in line.lower()
        ]
        if scheduler_lines:
            break
        time.sleep(0.2)
    assert scheduler_lines, f"no abort logged by the scheduler for {request_id}"
    # The server is still healthy and serving.
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})[0] == 200
