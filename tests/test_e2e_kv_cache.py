"""KV cache memory end to end, through the real process tree on CPU (tiny random Qwen3).

Greedy outputs of a mix of concurrent requests, some sharing long prefixes, must not depend
on how the KV cache is managed: prefix caching on or off, prefill chunked to 32 tokens, or a
cache so small that requests are preempted and recomputed. A prefix cache hit must show in
the usage (``prompt_tokens_details.cached_tokens``) and in the scheduler's count of prompt
tokens it computed (its "finished request" log line).
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_TOKENS = 12
# The tiny Qwen3 stores 2 layers x 2 KV heads x 32 dims in float32: 16 KiB per 16-token
# block. 24 blocks (384 tokens) hold about two of the requests below at a time.
SMALL_CACHE = "384KiB"
SMALL_CACHE_TOKENS = 384

_FINISHED = re.compile(
    r"finished request (\S+): (\d+) prompt \+ (\d+) completion tokens, "
    r"computed (\d+) prompt tokens, (\d+) cached, \w+, preempted (\d+)x"
)


def _workload() -> list[list[int]]:
    """12 token-id prompts: 4 share a 120-token prefix, 4 a 72-token one, 4 share nothing."""
    rng = random.Random(1234)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, 100_000) for _ in range(n)]

    prefix_a, prefix_b = tokens(120), tokens(72)
    prompts = [prefix_a + tokens(rng.randint(3, 20)) for _ in range(4)]
    prompts += [prefix_b + tokens(rng.randint(3, 20)) for _ in range(4)]
    prompts += [tokens(rng.randint(20, 60)) for _ in range(4)]
    rng.shuffle(prompts)
    return prompts


PROMPTS = _workload()


def _start(model_dir: str, log_path: str, *args: str) -> Server:
    return Server(
        "--model-path",
        model_dir,
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--block-size",
        str(BLOCK_SIZE),
        *args,
        log_path=log_path,
    ).wait_ready()


def _complete(server: Server, prompt: list[int], max_tokens: int = MAX_TOKENS) -> dict:
    status, body = server.post(
        "/v1/completions",
        {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert status == 200, body
    return body


def _run_workload(server: Server) -> list[list[int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        bodies = list(pool.map(lambda p: _complete(server, p), PROMPTS))
    return [body["choices"][0]["token_ids"] for body in bodies]


def _finished_lines(server: Server) -> dict[str, tuple[int, ...]]:
    """Request id -> (prompt, completion, computed prompt, cached, preemptions).

    Read once the server has stopped: the scheduler logs a request's end after its last
    token is on its way to the client, so a client can hold every answer before the last
    line is written.
    """
    return {
        m.group(1): tuple(int(g) for g in m.groups()[1:]) for m in _FINISHED.finditer(server.log())
    }


def _stop(server: Server) -> None:
    assert server.stop() == 0, server.log()[-4000:]
    assert server.leftovers() == []


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy tokens with nothing constrained: no prefix cache, a large cache, no chunking."""
    log = str(tmp_path_factory.mktemp("kv-ref") / "pegainfer.log")
    server = _start(tiny_qwen3_dir, log, "--no-prefix-cache", "--kv-cache-memory", "64MiB")
    try:
        outputs = _run_workload(server)
    finally:
        _stop(server)
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs)
    return outputs


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("prefix-cache", ["--kv-cache-memory", "64MiB"]),
        ("chunked-32", ["--kv-cache-memory", "64MiB", "--max-num-batched-tokens", "32"]),
        ("preemption", ["--kv-cache-memory", SMALL_CACHE]),
        (
            "preemption-chunked-no-prefix-cache",
            [
                "--no-prefix-cache",
                "--kv-cache-memory",
                SMALL_CACHE,
                "--max-num-batched-tokens",
                "32",
            ],
        ),
    ],
)
def test_outputs_do_not_depend_on_kv_cache_management(
    tiny_qwen3_dir: str, tmp_path, reference: list[list[int]], name: str, args: list[str]
) -> None:
    server = _start(tiny_qwen3_dir, str(tmp_path / "pegainfer.log"), *args)
    try:
        outputs = _run_workload(server)
        # Prefix caching: the same workload again is served from the cache, same tokens.
        again = _run_workload(server) if "--no-prefix-cache" not in args else outputs
    finally:
        _stop(server)
    finished = _finished_lines(server)
    for index, (got, want) in enumerate(zip(outputs, reference)):
        assert got == want, f"{name}: request {index} differs from the reference"
    assert again == reference, f"{name}: the repeated workload differs from the reference"
    assert len(finished) == (2 if again is not outputs else 1) * len(PROMPTS)
    preemptions = sum(line[4] for line in finished.values())
    cached = sum(line[3] for line in finished.values())
    if SMALL_CACHE in args:
        assert preemptions > 0, f"{name}: the small cache forced no preemption"
    if "--no-prefix-cache" in args:
        assert cached == 0
    else:
        assert cached > 0 and all(line[3] % BLOCK_SIZE == 0 for line in finished.values())


def test_prefix_cache_hit_is_reported_and_saves_prefill(tiny_qwen3_dir: str, tmp_path) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(1000, 100_000) for _ in range(200)]
    first_prompt, second_prompt = prefix + [11, 12, 13], prefix + [21, 22, 23, 24]
    server = _start(tiny_qwen3_dir, str(tmp_path / "on.log"), "--kv-cache-memory", "8MiB")
    try:
        first = _complete(server, first_prompt, max_tokens=2)
        second = _complete(server, second_prompt, max_tokens=2)
        # A prompt + max_tokens beyond the whole cache (8 MiB: 8192 tokens) is refused...
        status, error = server.post("/v1/completions", {"prompt": prefix, "max_tokens": 10_000})
        # ... and the server goes on serving.
        third = _complete(server, first_prompt, max_tokens=2)
    finally:
        _stop(server)
    finished = _finished_lines(server)
    assert status == 400 and error["error"]["type"] == "invalid_request_error"

    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full block of the shared 200 tokens: 12 blocks, 192 tokens.
    assert cached == 192 and cached % BLOCK_SIZE == 0
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 192
    # The scheduler computed that many fewer prompt tokens.
    first_line = finished[first["id"] + "-0"]
    second_line = finished[second["id"] + "-0"]
    assert first_line[:4] == (203, 2, 203, 0)
    assert second_line[:4] == (204, 2, 204 - cached, cached)

    # Without the prefix cache nothing is reported and everything is computed.
    server = _start(
        tiny_qwen3_dir, str(tmp_path / "off.log"), "--kv-cache-memory", "8MiB", "--no-prefix-cache"
    )
    try:
        _complete(server, first_prompt, max_tokens=2)
        second_off = _complete(server, second_prompt, max_tokens=2)
    finally:
        _stop(server)
    finished = _finished_lines(server)
    assert second_off["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert finished[second_off["id"] + "-0"][2:4] == (204, 0)
    assert second_off["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
