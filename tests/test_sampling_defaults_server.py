"""The model's generation_config.json sets the sampling of requests that leave it out, through
the real process tree. The tiny Qwen3's file here names top-k 1 (beside Qwen3's temperature
and top-p), which makes every default-sampled request greedy: observable on a random model, and
a max_new_tokens that caps every request's max_tokens."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time"
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def top_k_one_model(tiny_qwen3_dir, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("defaults") / "tiny-qwen3-top-k-1"
    out.mkdir()
    for name in os.listdir(tiny_qwen3_dir):
        source = os.path.join(tiny_qwen3_dir, name)
        if name.endswith(".safetensors"):
            os.symlink(source, out / name)
        elif name != "generation_config.json":
            shutil.copy(source, out / name)
    with open(os.path.join(tiny_qwen3_dir, "generation_config.json")) as f:
        generation = json.load(f)
    generation.update(
        do_sample=True, temperature=0.6, top_p=0.95, top_k=1, max_new_tokens=MAX_NEW_TOKENS
    )
    (out / "generation_config.json").write_text(json.dumps(generation))
    return str(out)


@pytest.fixture(scope="module")
def server(top_k_one_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("defaults-server") / "pegainfer.log"
    srv = Server(
        "--model-path", top_k_one_model, "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", "--max-num-batched-tokens", "64",
        "--override-generation-config", '{"min_p": 0.02}',
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


def token_ids(server, **body) -> list[list[int]]:
    fields = dict(prompt=PROMPT, max_tokens=8, ignore_eos=True, return_token_ids=True)
    status, out = server.post("/v1/completions", {**fields, **body})
    assert status == 200, out
    return [choice["token_ids"] for choice in out["choices"]]


def test_the_start_names_the_defaults(server):
    lines = [line for line in server.log().splitlines() if "default sampling from" in line]
    assert len(lines) == 1, server.log()[-3000:]
    for setting in ("temperature=0.6", "top_p=0.95", "top_k=1", "min_p=0.02", "max_new_tokens=12"):
        assert setting in lines[0]


def test_requests_without_sampling_fields_take_the_models_settings(server):
    (greedy,) = token_ids(server, temperature=0.0)
    # top-k 1 from the file: each of several unseeded choices is the greedy one.
    assert token_ids(server, n=3) == [greedy] * 3
    assert token_ids(server, top_k=None, temperature=None) == [greedy]
    status, out = server.post(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2},
    )
    assert status == 200, out
    first, second = (choice["message"]["content"] for choice in out["choices"])
    assert first == second


def test_a_requests_own_fields_win(server):
    (greedy,) = token_ids(server, temperature=0.0)
    sampled = token_ids(server, top_k=-1, temperature=1.0, min_p=0.0, n=4, seed=11)
    # Over the whole random vocabulary at temperature 1 no choice draws the greedy tokens.
    assert all(choice != greedy for choice in sampled)
    assert len({tuple(choice) for choice in sampled}) > 1


def test_max_new_tokens_caps_every_request(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    # Without max_tokens a chat answer may fill the context (256 here): the cap holds it to 12.
    for body in (chat, {**chat, "max_tokens": 100}, {"prompt": PROMPT, "max_tokens": 100}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        status, out = server.post(path, {**body, "ignore_eos": True})
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == MAX_NEW_TOKENS
        assert out["choices"][0]["finish_reason"] == "length"
    # Below the cap a request's own max_tokens holds; min_tokens past the cap is a 400.
    assert [len(ids) for ids in token_ids(server)] == [8]
    status, out = server.post("/v1/completions", {"prompt": PROMPT, "min_tokens": 20})
    assert status == 400 and out["error"]["param"] == "min_tokens", out
