"""OpenAI API conformance of the real process tree, with the `openai` client and raw HTTP:
sampling, stops, EOS, usage, tools and concurrency. The server is tests/eos_server.py's; logprobs,
templates and the other endpoints: test_api_endpoints.py. Real text (emoji, CJK):
test_api_real_text.py.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests import eos_server
from tests.eos_server import EOS_PROMPT, complete, greedy_ids, stream_completion
from tools.soak_mix import WEATHER_TOOL

pytestmark = pytest.mark.slow

# The shared server's fixtures, bound here so that pytest finds them in this module.
client = eos_server.client
eos_model = eos_server.eos_model
model = eos_server.model
server = eos_server.server
tokenizer = eos_server.tokenizer


# -- determinism and arithmetic --------------------------------------------------------------


def test_streaming_equals_non_streaming_at_temperature_zero(client, model):
    kwargs = dict(prompt="The quick brown fox", max_tokens=8, temperature=0)
    full = client.completions.create(model=model, extra_body={"ignore_eos": True}, **kwargs)
    chunks = stream_completion(client, model, extra_body={"ignore_eos": True}, **kwargs)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason] == ["length"]

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0
    )
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert chat.choices[0].message.reasoning_content is None  # no <think> block produced


def test_usage_arithmetic_is_exact(server, client, model, tokenizer):
    prompts = ["one two three", "four five"]
    out = complete(
        server, prompt=prompts, n=2, max_tokens=5, temperature=0.7, seed=1,
        return_token_ids=True, ignore_eos=True,
    )  # fmt: skip
    prompt_tokens = sum(len(tokenizer.encode(p).ids) for p in prompts)
    usage = out["usage"]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert usage["prompt_tokens"] == prompt_tokens  # each prompt counted once for n=2
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"]) == 20
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    chunks = stream_completion(
        client, model, prompt=prompts, n=2, max_tokens=5, temperature=0.7, seed=1,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == usage["prompt_tokens"]
    assert chunks[-1].usage.completion_tokens == usage["completion_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_n_gives_n_indices_each_finishing_once(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi"}],
            n=3,
            max_tokens=4,
            temperature=1.0,
            stream=True,
        )
    )
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    assert sorted(finishes) == [0, 1, 2]
    assert all(len(reasons) == 1 for reasons in finishes.values())


def test_seeded_sampling_is_reproducible_whatever_the_batch(server):
    body = dict(prompt="Once upon", max_tokens=6, temperature=1.0, seed=1234, ignore_eos=True)
    alone = complete(server, **body)["choices"][0]["text"]

    def other(i: int) -> str:
        return complete(server, prompt=f"noise {i}", max_tokens=6, temperature=1.0)["choices"][0][
            "text"
        ]

    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(other, i) for i in range(3)]
        batched = pool.submit(complete, server, **body)
        assert batched.result()["choices"][0]["text"] == alone
        for future in noise:
            future.result()
    different = complete(server, **{**body, "seed": 99})["choices"][0]["text"]
    assert different != alone


def test_qwen3_sampling_and_penalties_through_the_server(server):
    """Qwen3's recommended settings with a presence penalty (the top-k candidate path and
    the device-side token counts): a seeded request gives the same tokens alone and among
    other penalised and unseeded requests. Strong presence and frequency penalties make
    greedy decoding repeat itself less."""
    qwen3 = dict(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.5)
    body = dict(
        prompt="Once upon", max_tokens=8, seed=77, ignore_eos=True, return_token_ids=True, **qwen3
    )
    alone = complete(server, **body)["choices"][0]["token_ids"]

    def other(i: int) -> list[int]:
        fields = dict(prompt=f"noise {i}", max_tokens=8, ignore_eos=True, return_token_ids=True)
        extra = qwen3 if i % 2 else {"temperature": 1.0, "frequency_penalty": 0.7}
        return complete(server, **fields, **extra)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(4) as pool:
        noise = [pool.submit(other, i) for i in range(3)]
        batched = pool.submit(complete, server, **body)
        assert batched.result()["choices"][0]["token_ids"] == alone
        assert all(len(f.result()) == 8 for f in noise)
    greedy = dict(prompt="Hello", max_tokens=64, temperature=0.0, ignore_eos=True)
    plain = complete(server, **greedy, return_token_ids=True)["choices"][0]["token_ids"]
    repeats = len(plain) - len(set(plain))
    assert repeats > 0  # the random model repeats itself
    penalty = dict(frequency_penalty=2.0, presence_penalty=2.0)
    penalised = complete(server, **greedy, **penalty, return_token_ids=True)
    ids = penalised["choices"][0]["token_ids"]
    assert len(ids) == 64 and len(ids) - len(set(ids)) < repeats


# -- stopping -------------------------------------------------------------------------------


def _stop_across_tokens(tokenizer, ids: list[int], text: str) -> tuple[str, int]:
    """A stop string made of the end of token k and the start of token k + 1, and k."""
    for k in range(1, len(ids) - 1):
        head = tokenizer.decode(ids[: k + 1])
        nxt = tokenizer.decode(ids[: k + 2])
        if "\ufffd" in nxt or not text.startswith(nxt):
            continue
        last_len = len(head) - len(tokenizer.decode(ids[:k]))
        next_len = len(nxt) - len(head)
        if last_len >= 2 and next_len >= 2:
            stop = text[len(head) - 2 : len(head) + 2]
            if text.find(stop) == len(head) - 2:
                return stop, k + 1
    pytest.skip("no token boundary with two characters on each side in this output")


def test_stop_string_split_across_tokens(server, client, model, tokenizer):
    base = dict(prompt="The quick brown fox", max_tokens=12, temperature=0, ignore_eos=True)
    reference = complete(server, **base, return_token_ids=True)["choices"][0]
    text = reference["text"]
    stop, stop_token = _stop_across_tokens(tokenizer, reference["token_ids"], text)
    at = text.find(stop)

    out = complete(server, **base, stop=[stop, "never-appears"])
    choice = out["choices"][0]
    assert choice["text"] == text[:at]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert out["usage"]["completion_tokens"] == stop_token + 1

    included = complete(server, **base, stop=stop, include_stop_str_in_output=True)
    assert included["choices"][0]["text"] == text[: at + len(stop)]

    chunks = stream_completion(
        client, model, prompt=base["prompt"], max_tokens=12, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = [c.choices[0].text for c in chunks if c.choices]
    # Joined, the chunks are exactly the text before the stop: no chunk held any of it.
    assert "".join(pieces) == text[:at]
    last = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(last) == 1 and last[0].finish_reason == "stop"


def test_eos_min_tokens_and_ignore_eos(server, eos_model, tokenizer):
    model_dir, eos = eos_model
    body = dict(prompt=EOS_PROMPT, max_tokens=10, temperature=0, return_token_ids=True)
    free = complete(server, **body, ignore_eos=True)["choices"][0]
    assert free["finish_reason"] == "length" and len(free["token_ids"]) == 10
    at = free["token_ids"].index(eos)

    stopped = complete(server, **body)["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] is None
    assert stopped["token_ids"] == free["token_ids"][: at + 1]

    # Until min_tokens, EOS is never drawn: the next most likely token comes instead, as in
    # HF generate's min_new_tokens (and vLLM).
    later = complete(server, **body, min_tokens=at + 2)["choices"][0]
    ids = later["token_ids"]
    assert len(ids) >= at + 2 and eos not in ids[: at + 1]
    assert ids[:at] == free["token_ids"][:at]
    prompt_ids = tokenizer.encode(EOS_PROMPT).ids
    hf = greedy_ids(model_dir, prompt_ids, 10, min_new_tokens=at + 2, eos_token_id=[151645, eos])
    assert ids == hf


def test_tools_reach_qwen3s_template(server, client, model):
    """The tools are rendered into the prompt (the random model calls none of them: the
    parsing of calls is tested against a scripted engine, tests/test_tool_calls.py)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    common = dict(model=model, messages=messages, max_tokens=3, temperature=0)
    plain = client.chat.completions.create(**common)
    tools = client.chat.completions.create(**common, tools=[WEATHER_TOOL])
    hidden = client.chat.completions.create(**common, tools=[WEATHER_TOOL], tool_choice="none")
    assert tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert not tools.choices[0].message.tool_calls
    status, counted = server.post("/tokenize", {"messages": messages, "tools": [WEATHER_TOOL]})
    assert status == 200 and counted["count"] == tools.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(**common, tools=[WEATHER_TOOL], tool_choice="any")


def test_continue_final_message_prefills_the_answer(server, tokenizer):
    messages = [
        {"role": "user", "content": "The capital of France?"},
        {"role": "assistant", "content": "The capital is"},
    ]
    closed = {"messages": messages, "add_generation_prompt": False}
    prefilled = {**closed, "continue_final_message": True}
    status, counted = server.post("/tokenize", {**prefilled, "return_token_strs": True})
    assert status == 200
    text = tokenizer.decode(counted["tokens"], skip_special_tokens=False)
    assert text.endswith("The capital is")  # no end of turn: the model goes on from here
    status, whole = server.post("/tokenize", closed)
    assert status == 200 and whole["count"] > counted["count"]
    status, out = server.post("/v1/chat/completions", {**prefilled, "max_tokens": 3})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == counted["count"]


def test_logit_bias_bans_and_forces_tokens(server):
    body = dict(prompt="Once upon", max_tokens=6, ignore_eos=True, return_token_ids=True)
    plain = complete(server, **body, temperature=0)["choices"][0]["token_ids"]
    banned = complete(server, **body, temperature=0, logit_bias={str(plain[0]): -100})
    assert banned["choices"][0]["token_ids"][0] != plain[0]
    # +100 forces a token greedy or sampled, alone or beside rows without a bias.
    forced = dict(**body, logit_bias={"42": 100})
    with ThreadPoolExecutor(3) as pool:
        runs = [
            pool.submit(complete, server, **forced, temperature=0),
            pool.submit(complete, server, **forced, temperature=1.0, top_p=0.9, seed=5),
            pool.submit(complete, server, **body, temperature=0),
        ]
        greedy, sampled, other = (run.result()["choices"][0]["token_ids"] for run in runs)
    assert greedy == sampled == [42] * 6
    assert other == plain


def test_stop_token_ids_report_their_stop_reason(server):
    body = dict(prompt="Stop here", max_tokens=8, temperature=0, ignore_eos=True)
    ids = complete(server, **body, return_token_ids=True)["choices"][0]["token_ids"]
    target = ids[2]
    first = ids.index(target)
    choice = complete(server, **body, stop_token_ids=[target], return_token_ids=True)["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == target
    assert choice["token_ids"] == ids[: first + 1]


def test_max_completion_tokens_wins_over_max_tokens(client, model):
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count."}],
        max_tokens=9,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_many_concurrent_streams_all_finish(client, model):
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            chunks = stream_completion(
                client, model, prompt=f"p{i}", max_tokens=3, extra_body={"ignore_eos": True}
            )
            assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []
