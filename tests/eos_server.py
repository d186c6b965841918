"""The served tree that the API conformance tests share (test_api_conformance.py,
test_api_endpoints.py): the tiny random Qwen3 (real Qwen3 tokenizer and chat template),
copied with one change: a token its greedy output reaches is declared an EOS, so EOS,
ignore_eos and min_tokens can be tested on a random model. A test module that binds these
fixtures starts one server of its own."""

from __future__ import annotations

import json
import os
import shutil

import openai
import pytest
from tokenizers import Tokenizer

from tests.server_util import Server

MAX_MODEL_LEN = 512
EOS_PROMPT = "Hello world"
EOS_INDEX = 3  # the greedy output's token at this index becomes an EOS


def greedy_ids(model_dir: str, prompt_ids: list[int], count: int, **generate) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=count, do_sample=False, **generate
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def eos_model(tiny_qwen3_dir, tmp_path_factory) -> tuple[str, int]:
    """The tiny Qwen3 with an extra EOS that greedy decoding of EOS_PROMPT reaches."""
    tokenizer = Tokenizer.from_file(os.path.join(tiny_qwen3_dir, "tokenizer.json"))
    ids = greedy_ids(tiny_qwen3_dir, tokenizer.encode(EOS_PROMPT).ids, 8)
    index = next(i for i in range(EOS_INDEX, len(ids)) if ids[i] not in ids[:i])
    eos = ids[index]
    out = tmp_path_factory.mktemp("tiny-qwen3-eos") / "tiny-qwen3-eos"
    out.mkdir()
    for name in os.listdir(tiny_qwen3_dir):
        source = os.path.join(tiny_qwen3_dir, name)
        if name == "generation_config.json":
            continue
        if name.endswith(".safetensors"):
            os.symlink(source, out / name)
        else:
            shutil.copy(source, out / name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, eos]}))
    return str(out), eos


@pytest.fixture(scope="module")
def server(eos_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("conformance") / "pegainfer.log"
    srv = Server(
        "--model-path", eos_model[0], "--kv-cache-memory", "64MiB",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-batched-tokens", "64",
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(eos_model) -> str:
    return os.path.basename(eos_model[0])


@pytest.fixture(scope="module")
def tokenizer(eos_model) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(eos_model[0], "tokenizer.json"))


def complete(server, **body) -> dict:
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    return out


def stream_completion(client, model, **kwargs) -> list:
    return list(client.completions.create(model=model, stream=True, **kwargs))
