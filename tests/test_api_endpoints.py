"""OpenAI API conformance of the real process tree, continued (test_api_conformance.py):
logprobs, chat templates, the model, tokenizer, version and metrics endpoints."""

from __future__ import annotations

import pytest

from tests import eos_server
from tests.eos_server import MAX_MODEL_LEN, complete, stream_completion

pytestmark = pytest.mark.slow

# The shared server's fixtures, bound here so that pytest finds them in this module.
client = eos_server.client
eos_model = eos_server.eos_model
model = eos_server.model
server = eos_server.server
tokenizer = eos_server.tokenizer


# -- logprobs -------------------------------------------------------------------------------


def test_completion_logprobs_shape_and_greedy_consistency(server):
    out = complete(
        server, prompt="Logprobs are", max_tokens=5, temperature=0, logprobs=3, ignore_eos=True
    )
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    n = out["usage"]["completion_tokens"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == n
    assert len(logprobs["top_logprobs"]) == len(logprobs["text_offset"]) == n
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"] == [
        sum(len(t) for t in logprobs["tokens"][:i]) for i in range(n)
    ]
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]
    ):
        assert 3 <= len(top) <= 4 and value <= 0
        # Greedy: the chosen token is the most likely one.
        assert value == pytest.approx(max(top.values()), abs=1e-5)
        assert top[token] == pytest.approx(value, abs=1e-5)


def test_echo_with_logprobs_covers_the_prompt(server, tokenizer):
    prompt = "Echo this prompt back"
    out = complete(server, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True)
    choice = out["choices"][0]
    logprobs = choice["logprobs"]
    num_prompt = len(tokenizer.encode(prompt).ids)
    assert choice["text"].startswith(prompt)
    assert len(logprobs["tokens"]) == num_prompt + out["usage"]["completion_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"][:num_prompt]) == prompt
    assert all(v is not None and v <= 0 for v in logprobs["token_logprobs"][1:])


def test_chat_logprobs_and_top_logprobs(client, model):
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    out = client.chat.completions.create(**kwargs)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 4
    assert "".join(entry.token for entry in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode("utf-8", "backslashreplace") == entry.token
    streamed = [
        entry
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_streamed_echo_with_logprobs_matches_the_whole_answer(server, client, model):
    body = dict(prompt="Echo this prompt back", max_tokens=4, temperature=0, logprobs=1, echo=True)
    whole = complete(server, **body)["choices"][0]
    choices = [chunk.choices[0] for chunk in stream_completion(client, model, **body)]
    assert choices[0].text.startswith(body["prompt"])
    assert "".join(choice.text for choice in choices) == whole["text"]
    tokens = [token for c in choices if c.logprobs for token in c.logprobs.tokens]
    offsets = [offset for c in choices if c.logprobs for offset in c.logprobs.text_offset]
    assert tokens == whole["logprobs"]["tokens"] and offsets == whole["logprobs"]["text_offset"]


def _reference_logprobs(model_dir: str, ids: list[int]):
    """log_softmax of transformers' float32 forward over ``ids``: row t predicts token t + 1."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_prompt_logprobs(got: list, ids: list[int], reference, num_top: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for position in range(1, len(ids)):
        row, token = reference[position - 1], ids[position]
        entry = got[position]
        own = entry[str(token)]
        assert list(entry)[0] == str(token), "the prompt's own token comes first"
        assert own["logprob"] == pytest.approx(float(row[token]), abs=1e-3)
        # Both forwards run in float32 and agree to about 4e-6: a rank may only move among
        # the tokens that close to this one.
        likelier = int((row > row[token] + 1e-5).sum())
        assert likelier + 1 <= own["rank"] <= int((row > row[token] - 1e-5).sum())
        top = [(int(i), entry[str(int(i))]) for i in row.topk(num_top).indices]
        assert len(entry) == num_top + (own["rank"] > num_top)
        for rank, (token_id, value) in enumerate(top, start=1):
            assert value["logprob"] == pytest.approx(float(row[token_id]), abs=1e-3)
            assert value["rank"] == (own["rank"] if token_id == token else rank)


def test_prompt_logprobs_match_the_reference(server, eos_model, tokenizer):
    prompt = "Prompt logprobs name every token of the prompt"
    ids = tokenizer.encode(prompt).ids
    reference = _reference_logprobs(eos_model[0], ids)
    for _ in range(2):  # the second time, a prefix cache must not skip the prompt
        out = complete(server, prompt=prompt, max_tokens=1, n=2, prompt_logprobs=3)
        for choice in out["choices"]:
            _check_prompt_logprobs(choice["prompt_logprobs"], ids, reference, 3)
            assert choice["logprobs"] is None
        texts = [
            choice["prompt_logprobs"][p][str(ids[p])]["decoded_token"] for p in range(1, len(ids))
        ]
        assert tokenizer.decode(ids[:1]) + "".join(texts) == prompt
    # Beside echo: each keeps its own count, from one computation.
    out = complete(
        server, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
        prompt_logprobs=0,
    )  # fmt: skip
    choice = out["choices"][0]
    _check_prompt_logprobs(choice["prompt_logprobs"], ids, reference, 0)
    echoed = choice["logprobs"]["token_logprobs"][: len(ids)]
    assert echoed[1:] == [
        choice["prompt_logprobs"][p][str(ids[p])]["logprob"] for p in range(1, len(ids))
    ]
    assert all(len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])


def test_chat_prompt_logprobs_cover_the_rendered_prompt(server, client, model, eos_model):
    messages = [{"role": "user", "content": "What comes first?"}]
    status, rendered = server.post("/tokenize", {"messages": messages})
    assert status == 200
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 2}
    )
    got = out.model_extra["prompt_logprobs"]
    reference = _reference_logprobs(eos_model[0], rendered["tokens"])
    _check_prompt_logprobs(got, rendered["tokens"], reference, 2)
    assert (
        "prompt_logprobs"
        not in client.chat.completions.create(
            model=model, messages=messages, max_tokens=1
        ).model_extra
    )


# -- chat templates, reasoning, endpoints ---------------------------------------------------


def test_enable_thinking_changes_the_rendered_prompt(server, client, model):
    messages = [{"role": "user", "content": "Think?"}]
    counts = {}
    for thinking in (True, False):
        kwargs = {"enable_thinking": thinking}
        status, tokenized = server.post(
            "/tokenize", {"messages": messages, "chat_template_kwargs": kwargs}
        )
        assert status == 200
        out = client.chat.completions.create(
            model=model, messages=messages, max_tokens=1,
            extra_body={"chat_template_kwargs": kwargs},
        )  # fmt: skip
        assert out.usage.prompt_tokens == tokenized["count"]
        counts[thinking] = tokenized["count"]
    # Qwen3's template closes an empty think block in the prompt when thinking is off.
    assert counts[False] == counts[True] + 4


def test_models_tokenize_detokenize_version(server, model):
    status, body = server.get(f"/v1/models/{model}")
    assert status == 200 and body["id"] == model and body["max_model_len"] == MAX_MODEL_LEN
    status, body = server.get("/v1/models/not-this-one")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = server.post("/tokenize", {"prompt": "Hello 世界"})
    assert status == 200 and body["count"] == len(body["tokens"])
    status, back = server.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == "Hello 世界"
    status, body = server.get("/version")
    assert status == 200 and body["version"]


def test_metrics_count_what_was_served(server):
    import urllib.request

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(server.url("/metrics"), timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    before = scrape()
    complete(server, prompt="metrics", max_tokens=3, temperature=0, ignore_eos=True)
    import time

    time.sleep(0.6)  # the scheduler publishes its counters a few times a second
    after = scrape()
    label = "{" + next(k for k in after if k.startswith("pegainfer:healthy")).split("{")[1]

    def delta(name: str) -> float:
        return after[name + label] - before.get(name + label, 0.0)

    assert delta("pegainfer:generation_tokens_total") >= 3
    assert delta("pegainfer:time_to_first_token_seconds_count") == 1
    assert delta("pegainfer:e2e_request_latency_seconds_count") == 1
    assert delta("pegainfer:inter_token_latency_seconds_count") == 2
    assert delta("pegainfer:request_queue_time_seconds_count") == 1
    assert after["pegainfer:num_requests_running" + label] == 0
    for name in (
        "pegainfer:num_requests_waiting",
        "pegainfer:kv_cache_usage_perc",
        "pegainfer:prefix_cache_queries_total",
        "pegainfer:prefix_cache_hits_total",
        "pegainfer:num_preemptions_total",
        "pegainfer:prompt_tokens_total",
    ):
        assert name + label in after, name
