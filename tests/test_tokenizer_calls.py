"""/tokenize and /detokenize as calls answered by a tokenizer process: the answers as pure
functions, then over the real process's sockets, next to generation requests."""

from __future__ import annotations

import os

from frontend_proc.chat_template import ChatTemplate
from frontend_proc.preprocess import Preprocessor
from frontend_proc.tokenizer_calls import answer
from pegainfer import ipc
from pegainfer.protocol import (
    DetokenizeRequest,
    DetokenizeResult,
    GenerateRequest,
    ProcessReady,
    RequestRejected,
    SamplingParams,
    TokenizedRequest,
    TokenizeRequest,
    TokenizeResult,
    pack_ids,
    unpack_ids,
)
from tests.test_tokenizer_proc import (
    VOCAB,
    WORDS,
    running_tokenizer,
    tiny_tokenizer,
    write_model_dir,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tokenize_call(request_id: str = "t", **fields) -> TokenizeRequest:
    values = dict(
        prompt=None,
        messages=None,
        chat_template_kwargs={},
        add_generation_prompt=True,
        add_special_tokens=True,
        return_token_strs=False,
    )
    values.update(fields)
    return TokenizeRequest(request_id=request_id, **values)


def preprocessor(tmp_path, with_template: bool = True) -> Preprocessor:
    template = ChatTemplate.load(write_model_dir(tmp_path)) if with_template else None
    return Preprocessor(tiny_tokenizer(), template, 16, len(WORDS))


def test_tokenize_prompt_with_and_without_special_tokens(tmp_path):
    pre = preprocessor(tmp_path)
    out = answer(pre, tokenize_call(prompt="hello the cat", return_token_strs=True))
    assert isinstance(out, TokenizeResult) and out.request_id == "t"
    assert unpack_ids(out.token_ids) == [VOCAB[w] for w in ("<s>", "hello", "the", "cat")]
    assert out.token_strs == ["<s>", "hello", "the", "cat"]
    out = answer(pre, tokenize_call(prompt="hello", add_special_tokens=False))
    assert unpack_ids(out.token_ids) == [VOCAB["hello"]] and out.token_strs is None


def test_tokenize_messages_renders_the_template(tmp_path):
    messages = [{"role": "user", "content": "hello"}]
    out = answer(preprocessor(tmp_path), tokenize_call(messages=messages, add_special_tokens=False))
    words = ["<s>", "<|user|>", "hello", "</s>", "<|assistant|>"]
    assert unpack_ids(out.token_ids) == [VOCAB[w] for w in words]
    rejected = answer(preprocessor(tmp_path, with_template=False), tokenize_call(messages=messages))
    assert isinstance(rejected, RequestRejected) and rejected.status == 400
    assert "no chat template" in rejected.message


def test_detokenize_keeps_special_tokens_and_rejects_unknown_ids(tmp_path):
    pre = preprocessor(tmp_path)
    ids = [VOCAB["<s>"], VOCAB["hello"], VOCAB["world"]]
    out = answer(pre, DetokenizeRequest("d", pack_ids(ids)))
    assert isinstance(out, DetokenizeResult)
    assert out.text == tiny_tokenizer().decode(ids, skip_special_tokens=False)
    rejected = answer(pre, DetokenizeRequest("d", pack_ids([1, len(WORDS)])))
    assert isinstance(rejected, RequestRejected)
    assert (rejected.request_id, rejected.status, rejected.param) == ("d", 400, "tokens")
    assert f"token id {len(WORDS)} is out of vocabulary" in rejected.message


def test_a_failing_tokenizer_costs_one_call(tmp_path):
    pre = preprocessor(tmp_path)

    class Broken:
        def encode(self, *args, **kwargs):
            raise RuntimeError("tokenizer bug")

    pre.tokenizer = Broken()
    out = answer(pre, tokenize_call(prompt="hello"))
    assert isinstance(out, RequestRejected) and (out.status, out.error_type) == (
        500,
        "server_error",
    )


def test_tokenizer_process_answers_calls_to_the_frontend(tmp_path):
    with running_tokenizer(tmp_path) as tokenizer:
        proc, launcher, to_tokenizers = tokenizer.proc, tokenizer.launcher, tokenizer.to_tokenizers
        scheduler, frontend = tokenizer.scheduler, tokenizer.frontend
        ready = ipc.recv(launcher, (ProcessReady,), "launcher", timeout_ms=30_000)
        assert isinstance(ready, ProcessReady) and ready.info["reasoning"] is False
        ipc.send(to_tokenizers, tokenize_call("tok", prompt="hello world"))
        ipc.send(to_tokenizers, DetokenizeRequest("bad", pack_ids([999])))
        generate = GenerateRequest(
            "gen", "the cat", None, None, {}, True, SamplingParams(max_tokens=4), 1.0
        )
        ipc.send(to_tokenizers, generate)
        ipc.send(to_tokenizers, DetokenizeRequest("detok", pack_ids([5, 6])))
        answers = {}
        for _ in range(3):
            msg = ipc.recv(
                frontend, (TokenizeResult, DetokenizeResult, RequestRejected), "frontend", 10_000
            )
            answers[msg.request_id] = msg
        assert unpack_ids(answers["tok"].token_ids) == [VOCAB["<s>"], VOCAB["hello"], 6]
        assert isinstance(answers["bad"], RequestRejected) and answers["bad"].status == 400
        assert answers["detok"].text == "hello world"
        accepted = ipc.recv(scheduler, (TokenizedRequest,), "scheduler", timeout_ms=10_000)
        assert accepted.request_id == "gen"  # generation still goes to the scheduler
        assert not frontend.poll(100) and proc.poll() is None
