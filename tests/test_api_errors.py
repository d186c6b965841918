"""Every error the API can answer, from the real process tree: its status, its OpenAI error
body, and a server that answers the next request normally."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow

KEYS = ("first-key", "second-key")
MAX_MODEL_LEN = 256
MAX_REQUEST_BYTES = 20_000
MAX_WAITING = 2


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("errors") / "pegainfer.log"
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--kv-cache-memory", "64MiB",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
        "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--max-request-bytes", str(MAX_REQUEST_BYTES),
        "--max-waiting-requests", str(MAX_WAITING),
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


def call(
    server, path: str, body=None, key: str | None = KEYS[0], method: str | None = None
) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one request."""
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(server.url(path), data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            raw = resp.read()
            return resp.status, dict(resp.headers), json.loads(raw) if raw else {}
    except urllib.error.HTTPError as err:
        raw = err.read()
        return err.code, dict(err.headers), json.loads(raw) if raw else {}


def assert_error(out: dict, param: str | None = None, code: str | None = None) -> None:
    assert set(out) == {"error"}, out
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert isinstance(out["error"]["message"], str) and out["error"]["message"]
    if param is not None:
        assert out["error"]["param"] == param, out
    if code is not None:
        assert out["error"]["code"] == code, out


def assert_still_serving(server) -> None:
    status, _, out = call(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2})
    assert status == 200 and out["choices"][0]["finish_reason"] in ("stop", "length"), out


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", None, None),
    ("/v1/completions", b"[1, 2]", None, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", None),
    ("/v1/completions", {"prompt": "x", "stop": ""}, "stop", None),
    ("/v1/completions", {"prompt": "x", "stop": []}, "stop", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {str(10**9): 1}}, "logit_bias", None),
    ("/v1/completions", {"prompt": [1, 2], "logit_bias": {str(10**9): 1}}, "logit_bias", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logit_bias": [1, 2]}, "logit_bias", None),
    ("/v1/completions", {"prompt": [[]]}, "prompt", None),
    ("/v1/completions", {"prompt": [10**9]}, "prompt", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": list(range(10, 10 + MAX_MODEL_LEN + 5)), "max_tokens": 1},
     "prompt", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": []}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10**6}, None, "context_length_exceeded"),
]  # fmt: skip


@pytest.mark.parametrize("path,body,param,code", BAD_REQUESTS)
def test_bad_requests_are_400_with_an_error_body(server, path, body, param, code):
    status, _, out = call(server, path, body)
    assert status == 400, out
    assert_error(out, param, code)
    assert out["error"]["type"] == "invalid_request_error"


def test_the_server_serves_normally_after_bad_requests(server):
    for path, body, _, _ in BAD_REQUESTS[:5]:
        call(server, path, body)
    assert_still_serving(server)


def test_api_keys(server):
    for key in (None, "wrong-key", KEYS[0] + "x"):
        status, _, out = call(server, "/v1/completions", {"prompt": "x"}, key=key)
        assert status == 401
        assert_error(out, code="invalid_api_key")
    status, _, _ = call(server, "/v1/models", key=None)
    assert status == 401
    for key in KEYS:
        status, _, _ = call(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, key=key)
        assert status == 200
    for path in ("/health", "/metrics"):
        with urllib.request.urlopen(server.url(path), timeout=10) as resp:
            assert resp.status == 200
    assert_still_serving(server)


def test_unknown_model_route_and_method(server):
    status, _, out = call(server, "/v1/completions", {"prompt": "x", "model": "gpt-5"})
    assert status == 404
    assert_error(out, "model", "model_not_found")
    status, _, out = call(server, "/v1/models/gpt-5")
    assert status == 404
    assert_error(out, code="model_not_found")
    status, _, out = call(server, "/v1/nothing-here", {})
    assert status == 404
    assert_error(out)
    status, _, out = call(server, "/v1/completions", method="GET")
    assert status == 405
    assert_error(out)
    assert_still_serving(server)


def test_body_over_the_limit_is_413(server):
    status, _, out = call(server, "/v1/completions", {"prompt": "x" * MAX_REQUEST_BYTES})
    assert status == 413
    assert_error(out)
    assert str(MAX_REQUEST_BYTES) in out["error"]["message"]
    assert_still_serving(server)


def metrics(server) -> dict[str, float]:
    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name.split("{")[0]] = float(value)
    return samples


def wait_idle(server, timeout: float = 3.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        sample = metrics(server)
        idle = (
            sample["pegainfer:num_requests_running"] == 0
            and sample["pegainfer:num_requests_waiting"] == 0
            and sample["pegainfer:kv_cache_usage_perc"] == 0
            and sample["pegainfer:num_requests_in_flight"] == 0
        )
        if idle or time.monotonic() > deadline:
            return sample
        time.sleep(0.1)


def test_queue_overflow_is_503_with_retry_after(server):
    body = {"prompt": "Tell me a long story", "max_tokens": 40, "ignore_eos": True}

    def one(_: int) -> tuple[int, dict, dict]:
        return call(server, "/v1/completions", body)

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(one, range(12)))
    statuses = sorted(status for status, _, _ in outcomes)
    assert statuses.count(200) >= 2, statuses
    refused = [(headers, out) for status, headers, out in outcomes if status == 503]
    assert refused, statuses
    assert set(statuses) == {200, 503}, statuses
    for headers, out in refused:
        assert headers.get("Retry-After") == "1"
        assert_error(out, code="server_overloaded")
    sample = wait_idle(server)
    assert sample["pegainfer:num_requests_running"] == 0, sample
    assert_still_serving(server)
