"""vLLM's request extensions through the real process tree, on the tiny random Qwen3."""

from __future__ import annotations

import pytest

from frontend_proc.engine_extras import bad_words_token_ids
from tests.server_util import Server

pytestmark = pytest.mark.slow

# Served instead of the model's own template (--chat-template).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nAnswer briefly: {% endif %}"
)


@pytest.fixture(scope="module")
def server(tiny_qwen3_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("extras")
    log = folder / "pegainfer.log"
    template = folder / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", "--block-size", "16", "--chat-template", str(template),
        "--reasoning-parser", "qwen3",
        log_path=str(log),
    ).wait_ready()  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


def complete(server, **body) -> dict:
    status, out = server.post("/v1/completions", {"max_tokens": 12, "temperature": 1.0, **body})
    assert status == 200, out
    return out


def test_allowed_token_ids_are_the_only_tokens_drawn(server):
    allowed = [9707, 11, 1879, 374, 0]
    for seed in range(3):
        out = complete(server, prompt="Say:", allowed_token_ids=allowed, seed=seed, return_token_ids=True)  # fmt: skip
        tokens = out["choices"][0]["token_ids"]
        assert len(tokens) == 12 and set(tokens) <= set(allowed)


def test_a_truncated_prompt_keeps_its_tail(server):
    ids = list(range(1000, 1040))
    whole = complete(server, prompt=ids[-8:], temperature=0)
    cut = complete(server, prompt=ids, truncate_prompt_tokens=8, temperature=0)
    assert cut["usage"]["prompt_tokens"] == 8
    assert cut["choices"][0]["text"] == whole["choices"][0]["text"]
    text = complete(server, prompt="one two three four five six seven", truncate_prompt_tokens=3)
    assert text["usage"]["prompt_tokens"] == 3
    status, out = server.post("/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 300})
    assert status == 400 and out["error"]["param"] == "truncate_prompt_tokens"


def test_a_cache_salt_keeps_cached_prefixes_to_its_own_requests(server):
    prompt = list(range(2000, 2070))  # 4 full blocks of 16 and some
    cached = {}
    for name, salt in (("a", "x"), ("b", "y"), ("c", "x"), ("d", None)):
        extra = {} if salt is None else {"cache_salt": salt}
        out = complete(server, prompt=prompt, max_tokens=1, **extra)
        cached[name] = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == {"a": 0, "b": 0, "c": 64, "d": 0}


def test_bad_words_are_never_written(server, tiny_qwen3_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")
    body = dict(prompt=[1000, 1001, 1002], temperature=0, max_tokens=40, return_token_ids=True)
    free = complete(server, **body)["choices"][0]["token_ids"]

    # Two words the model writes unbanned, as their text, whose text the tokenizer process
    # splits into those very tokens again (at the start, or after one space).
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    words, sequences = [], []
    for length in (2, 3):
        for start in range(2, len(free) - length):
            span = free[start : start + length]
            word = tokenizer.decode(span)
            if span in bad_words_token_ids([word], encode):
                words.append(word)
                sequences += bad_words_token_ids([word], encode)
                break
    assert len(words) == 2, free
    banned = complete(server, **body, bad_words=words)["choices"][0]["token_ids"]
    assert banned != free
    for ids in sequences:
        assert not any(banned[i : i + len(ids)] == ids for i in range(len(banned))), (ids, banned)
    # The same request with a text prompt, and through chat.
    status, _ = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "bad_words": words})  # fmt: skip
    assert status == 200


def test_logprobs_name_tokens_by_id_on_request(server):
    body = dict(prompt="Say:", temperature=0, max_tokens=6, logprobs=2, return_token_ids=True)
    out = complete(server, **body, return_tokens_as_token_ids=True)["choices"][0]
    assert out["logprobs"]["tokens"] == [f"token_id:{t}" for t in out["token_ids"]]
    status, chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True})  # fmt: skip
    assert status == 200
    assert all(
        c["token"].startswith("token_id:") for c in chat["choices"][0]["logprobs"]["content"]
    )


def test_unsupported_extensions_are_400s(server):
    for body, param in (({"bad_words": [""]}, "bad_words"), ({"priority": 1}, "priority")):
        status, out = server.post("/v1/completions", {"prompt": "hi", **body})
        assert status == 400 and out["error"]["param"] == param


def test_a_priority_server_takes_priorities(tiny_qwen3_dir, tmp_path):
    srv = Server(
        "--model-path", tiny_qwen3_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", "--scheduling-policy", "priority",
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip
    try:
        for priority in (-5, 0, 7):
            out = complete(srv, prompt="Say:", priority=priority, temperature=0)
            assert out["choices"][0]["finish_reason"] == "length"
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.leftovers() == []


def test_the_chat_template_given_at_start_up_renders_chats(server, tiny_qwen3_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(f"{tiny_qwen3_dir}/tokenizer.json")
    messages = [{"role": "user", "content": "hi"}]
    status, rendered = server.post("/tokenize", {"messages": messages})
    assert status == 200
    text = tokenizer.decode(rendered["tokens"], skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nAnswer briefly: "
    status, chat = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200 and chat["usage"]["prompt_tokens"] == rendered["count"]
    for route in ("/v1/chat/completions", "/tokenize"):
        status, out = server.post(route, {"messages": messages, "chat_template": "{{ 1 }}"})
        assert status == 400 and out["error"]["param"] == "chat_template", out


def test_a_named_reasoning_parser_splits_chats_under_any_template(server):
    # The template given at start-up never writes the think tags, so "auto" would not split.
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "<think>\nLet me see"},
    ]
    body = {"messages": messages, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False}
    status, out = server.post("/v1/chat/completions", {**body, "continue_final_message": True})
    assert status == 200, out
    message = out["choices"][0]["message"]
    # The prompt opened the think block: the output starts as reasoning.
    assert message["reasoning_content"], message
