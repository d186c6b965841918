"""Overlapped scheduling through the real process tree on the CPU: two steps in flight
(the default) and ``--no-overlap`` give the same greedy tokens and finish reasons for a
mix of concurrent requests, some of them ended by stop tokens found one step late."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_util import Server

pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

NUM_REQUESTS = 12


def _serve(model_dir: str, log_path: str, *extra: str) -> Server:
    return Server(
        "--model-path",
        model_dir,
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "48",  # chunked prefill mixed with decodes
        "--dtype",
        "float32",
        *extra,
        log_path=log_path,
    ).wait_ready()


def _complete_all(server: Server, bodies: list[dict]) -> list[tuple[list[int], str]]:
    def run(body: dict) -> tuple[list[int], str]:
        status, reply = server.post("/v1/completions", body)
        assert status == 200, reply
        choice = reply["choices"][0]
        return choice["token_ids"], choice["finish_reason"]

    with ThreadPoolExecutor(NUM_REQUESTS) as pool:
        return list(pool.map(run, bodies))


def _bodies(stops: dict[int, int] | None = None) -> list[dict]:
    rng = random.Random(4)
    words = "the a river stone blue quickly runs over under light seven".split()
    bodies = []
    for i in range(NUM_REQUESTS):
        prompt = " ".join(rng.choice(words) for _ in range(1 + 3 * i))
        body = {
            "prompt": prompt,
            "max_tokens": 4 + (7 * i) % 23,
            "temperature": 0,
            "return_token_ids": True,
        }
        if stops and i in stops:
            body["stop_token_ids"] = [stops[i]]
            body["max_tokens"] = 40
        bodies.append(body)
    return bodies


def test_overlap_and_no_overlap_give_the_same_tokens(tiny_qwen3_dir, tmp_path):
    results = {}
    for mode, extra in (("no-overlap", ("--no-overlap",)), ("overlap", ())):
        server = _serve(tiny_qwen3_dir, str(tmp_path / f"{mode}.log"), *extra)
        try:
            plain = _complete_all(server, _bodies())
            # Stop every third request on the third token it produced without a stop.
            stops = {i: plain[i][0][2] for i in range(0, NUM_REQUESTS, 3) if len(plain[i][0]) > 2}
            stopped = _complete_all(server, _bodies(stops))
            log = server.log()
        finally:
            assert server.stop() == 0
        assert server.leftovers() == []
        expected_in_flight = 1 if mode == "no-overlap" else 2
        assert f"max_steps_in_flight={expected_in_flight}" in log
        results[mode] = (plain, stops, stopped)

    assert results["overlap"] == results["no-overlap"]
    plain, stops, stopped = results["overlap"]
    assert len(stops) >= 3
    for i, (tokens, reason) in enumerate(plain):
        assert reason == "length" and len(tokens) == 4 + (7 * i) % 23
    for i, stop in stops.items():
        tokens, reason = stopped[i]
        cut = plain[i][0].index(stop) + 1
        assert reason == "stop" and tokens == plain[i][0][:cut]
