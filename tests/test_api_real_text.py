"""Real text through the whole process tree: emoji and CJK, streamed and not, on SmolLM2
(a real model, whose greedy continuations of these prompts are emoji and CJK)."""

from __future__ import annotations

import openai
import pytest

from tests.server_util import Server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol_server(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("conformance-smol") / "pegainfer.log"
    srv = Server(
        "--model-path", smollm2_dir, "--kv-cache-memory", "64MiB", "--max-model-len", "256",
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


@pytest.mark.parametrize(
    "prompt",
    [
        "Party emoji: 🎉. Rocket emoji: 🚀. Heart emoji:",
        "中文：你好，世界。日本語：こんにちは。中文：",
    ],
)
def test_emoji_and_cjk_stream_without_replacement_characters(smol_server, prompt):
    client = openai.OpenAI(base_url=smol_server.url("/v1"), api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, prompt=prompt, max_tokens=6, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(pieces) == full
    assert any(len(ch.encode()) >= 3 for ch in full), f"no emoji or CJK in {full!r}"
    # Only a character cut off by max_tokens may end the text as U+FFFD (its last bytes
    # were never generated); no streamed chunk before the end may hold one.
    assert "\ufffd" not in full.rstrip("\ufffd")
    assert all("\ufffd" not in piece for piece in pieces[:-1])
    assert "\ufffd" not in pieces[-1].rstrip("\ufffd")
