"""Property-based fuzz of request bodies against the real process tree: every answer is a
200 or a 4xx with an error body, never a 5xx, and the server stays up."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.server_util import Server

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
# Bodies start valid (short generations) and get up to three fields replaced by garbage of
# any type, or by values just outside their range; unknown fields are added too.
token_ids = st.lists(st.integers(0, 150_000), min_size=1, max_size=6)
valid_common = {
    "max_tokens": st.integers(1, 6),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 3),
    "stop": st.text(min_size=1, max_size=3)
    | st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 150_000), max_size=3),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.1, 2.0),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans(), "continuous_usage_stats": st.booleans()}
    ),
    "prompt_logprobs": st.integers(0, 3),
    "add_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
}
out_of_range = st.sampled_from([-1, 0, 21, 10**9, -(10**30), 2.5, "", [], {}, True, None])
garbage = json_values | out_of_range


def mutated(valid: dict) -> st.SearchStrategy:
    names = sorted(valid) + ["unknown_field", "messages", "prompt", "model", "logit_bias"]

    def apply(parts: tuple[dict, dict]) -> dict:
        body, changes = parts
        body = {**body, **changes}
        # An absent max_tokens in chat fills the context: slow, and not what is fuzzed here.
        if body.get("max_tokens") is None and "messages" in valid:
            body["max_tokens"] = 2
        return body

    return st.tuples(
        st.fixed_dictionaries({}, optional=valid),
        st.dictionaries(st.sampled_from(names), garbage, max_size=3),
    ).map(apply)


prompt = (
    st.text(min_size=1, max_size=24)
    | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3)
    | token_ids
    | st.lists(token_ids, min_size=1, max_size=2)
)
completion_bodies = st.tuples(
    st.fixed_dictionaries({"prompt": prompt, "max_tokens": st.integers(1, 6)}),
    mutated({**valid_common, "logprobs": st.integers(0, 5), "echo": st.booleans()}),
).map(lambda parts: {**parts[0], **parts[1]})
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer"]),
        "content": st.text(max_size=12),
    }
)
chat_bodies = st.tuples(
    st.fixed_dictionaries(
        {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)}
    ),
    mutated(
        {
            **valid_common,
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 5),
            "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
            "max_completion_tokens": st.integers(1, 6),
        }
    ),
).map(lambda parts: {**parts[0], **parts[1]})
response_bodies = st.tuples(
    st.fixed_dictionaries(
        {
            "input": st.text(min_size=1, max_size=12) | st.lists(message, min_size=1, max_size=2),
            "max_output_tokens": st.integers(1, 6),
        }
    ),
    mutated(
        {
            "instructions": st.text(max_size=8),
            "temperature": st.floats(0.0, 2.0),
            "top_p": st.floats(0.01, 1.0),
            "stream": st.booleans(),
            "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["none", "low"])}),
            "text": st.just({"format": {"type": "json_object"}}),
        }
    ),
).map(lambda parts: {**parts[0], **parts[1]})
requests_ = (
    st.tuples(st.just("/v1/completions"), completion_bodies)
    | st.tuples(st.just("/v1/responses"), response_bodies | json_values)
    | st.tuples(st.just("/v1/chat/completions"), chat_bodies)
    | st.tuples(st.sampled_from(["/v1/completions", "/tokenize", "/detokenize"]), json_values)
    | st.tuples(st.just("/v1/chat/completions"), st.binary(max_size=40))
)


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "pegainfer.log"
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--kv-cache-memory", "64MiB",
        "--max-model-len", str(MAX_MODEL_LEN), log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    status, _ = srv.get("/health")
    assert status == 200
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []
    assert "Traceback" not in srv.log(), srv.log()[-5000:]


def encode(body) -> bytes:
    if isinstance(body, bytes):
        return body
    # Python's json writes NaN and Infinity, as some clients do; the server must cope.
    return json.dumps(body).encode()


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests_)
def test_fuzzed_bodies_get_200_or_4xx_never_5xx(server, request):
    path, body = request
    req = urllib.request.Request(
        server.url(path), data=encode(body), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    event(f"{path} {status}")
    assert status == 200 or 400 <= status < 500, (status, raw[:500])
    if status != 200:
        error = json.loads(raw)["error"]
        assert error["message"] and error["type"]
    elif raw.startswith(b"data: "):
        assert raw.endswith(b"data: [DONE]\n\n")
        assert b'"server_error"' not in raw, raw[-500:]
    elif raw.startswith(b"event: "):  # a Responses stream ends with the whole response
        last = raw.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith((b"event: response.completed", b"event: response.incomplete"))
        assert b"event: error" not in raw, raw[-500:]
    else:
        json.loads(raw)
