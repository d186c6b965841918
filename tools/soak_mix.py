"""The soak test's request mix (tools/soak.py) and the clients that send it: completions,
chats and responses (the Responses API), streamed or not, across the sampling paths, constraints and extensions a server
keeps per-request state for; some cancelled halfway, some invalid on purpose. Each answer
is counted as served, refused, cancelled or failed; a refusal of a request the mix meant to
be served (a constraint refused where xgrammar cannot load, say) also counts as unexpected."""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Explain recursion in one sentence.",
    "你好，请介绍一下你自己。",
    "Emoji story: 🐱🚀",
]


@dataclass
class Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    ok: int = 0
    refused: int = 0  # 4xx on purpose, or 503 from overload
    unexpected: int = 0  # of the refused: a 4xx to a request the mix meant to be served
    cancelled: int = 0
    failed: int = 0  # a 5xx other than 503, an error event, a broken connection, a hang
    tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)  # of the responses that were not 200
    # "400: <the error's message>" -> count, so that a verdict tells why requests were refused.
    refusals: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, outcome: str, tokens: int = 0, error: str | None = None) -> None:
        with self.lock:
            setattr(self, outcome, getattr(self, outcome) + 1)
            self.tokens += tokens
            if error and len(self.errors) < 20:
                self.errors.append(error)

    def add_status(self, status: int, body: bytes, refusable: bool = True) -> None:
        """A response that was not 200: refused when the server meant it (4xx, or 503 while
        overloaded), failed when the server broke (any other 5xx). A 4xx to a request that
        is not ``refusable`` is a refusal the mix did not mean: unexpected as well."""
        with self.lock:
            self.statuses[status] = self.statuses.get(status, 0) + 1
        if status >= 500 and status != 503:
            self.add("failed", error=f"HTTP {status}: {body[:200].decode(errors='replace')}")
            return
        reason = f"{status}: {refusal_message(body)}"
        with self.lock:
            if reason in self.refusals or len(self.refusals) < MAX_REFUSAL_REASONS:
                self.refusals[reason] = self.refusals.get(reason, 0) + 1
            if status != 503 and not refusable:
                self.unexpected += 1
                if len(self.errors) < 20:
                    self.errors.append(f"unexpected refusal {reason}")
        self.add("refused")


MAX_REFUSAL_REASONS = 50  # distinct messages kept; a message that names a value varies


def refusal_message(body: bytes) -> str:
    """An error response's message (OpenAI's ``{"error": {"message": ...}}``), cut short."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace")
    return str(message)[:120]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


# Structured output: each kind of constraint, and one that does not compile (a 400 from the
# scheduler, after the request was accepted).
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
BROKEN_REGEX = "[0-9"
CONSTRAINT_FIELDS = ("structured_outputs", "guided_regex", "response_format")
CONSTRAINTS = (
    {"structured_outputs": {"choice": ["yes", "no", "maybe"]}},
    {"guided_regex": "[a-z]{2,12}( [a-z]{2,12}){0,3}"},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "reply",
                "schema": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                    "required": ["ok"],
                },
            },
        }
    },
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"grammar": 'start: WORD ("," WORD)*\n%import common.WORD'}},
    {
        "response_format": {
            "type": "structural_tag",
            "triggers": ["<call="],
            "structures": [{"begin": "<call=f>", "schema": {"type": "object"}, "end": "</call>"}],
        }
    },
    {"guided_regex": BROKEN_REGEX},
)
# vLLM's extensions: each keeps per-request state somewhere (the worker's edits, the
# scheduler's bans, the prefix cache's salted roots).
EXTENSIONS = (
    {"allowed_token_ids": list(range(100, 600))},
    {"bad_words": ["the", "and then", "of the"]},
    {"cache_salt": "tenant-a"},
    {"cache_salt": "tenant-b"},
    {"truncate_prompt_tokens": 4},
)


def request_body(rng: random.Random) -> tuple[str, dict]:
    max_tokens = rng.randint(4, 48)
    if rng.random() < 0.05:  # invalid on purpose: the server must shrug it off
        return "/v1/completions", {"prompt": "x", "max_tokens": -1}
    stream = rng.random() < 0.5
    common = {"max_tokens": max_tokens, "temperature": rng.choice([0, 0.7, 1.0]), "stream": stream}
    # Each sampling path of the worker: Qwen3's settings (top-k candidates), penalties (a
    # row of token counts held while the request lives), seeds.
    # And none at all: the server's defaults (the model's generation_config.json).
    kind = rng.random()
    if kind < 0.25:
        common.update(temperature=0.6, top_p=0.95, top_k=20)
    elif kind < 0.4:
        common.update(presence_penalty=rng.choice([0.5, 1.5]), frequency_penalty=0.3)
    elif kind < 0.5:
        del common["temperature"]
    elif kind < 0.55:  # logit edits: a bias, and stop tokens masked until min_tokens
        common.update(logit_bias={str(rng.randrange(1000)): rng.choice([-100, 5])})
        common.update(min_tokens=rng.randint(1, max_tokens))
    if rng.random() < 0.2:
        common["seed"] = rng.randrange(2**31)
    if rng.random() < 0.08:
        common.update(rng.choice(CONSTRAINTS))
    if rng.random() < 0.1:
        common.update(rng.choice(EXTENSIONS))
    if stream and rng.random() < 0.5:
        common["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {"prompt": rng.choice(PROMPTS), **common}
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.5:
        # A reasoning model's chat constraint holds after its </think>; without thinking,
        # from the first token.
        common["chat_template_kwargs"] = {"enable_thinking": False}
    if rng.random() < 0.1:  # rendered by templates that take tools, refused by the others
        common["tools"] = [WEATHER_TOOL]
        if rng.random() < 0.3 and not any(key in common for key in CONSTRAINT_FIELDS):
            common["tool_choice"] = rng.choice(["required", NAMED_WEATHER])
    plain = not {"tools", "min_tokens", *CONSTRAINT_FIELDS} & set(common)
    if plain and rng.random() < 0.3:  # the same conversation through the Responses API
        common.pop("stream_options", None)
        common["max_output_tokens"] = common.pop("max_tokens")
        return "/v1/responses", {"input": messages, **common}
    return "/v1/chat/completions", {"messages": messages, **common}


def may_be_refused(body: dict) -> bool:
    """Whether a 4xx is a right answer to this body: invalid on purpose, a constraint that
    does not compile, or tools (which a chat template that takes none refuses)."""
    return (
        body.get("max_tokens") == -1 or body.get("guided_regex") == BROKEN_REGEX or "tools" in body
    )


def client_loop(
    host: str, port: int, deadline: float, seed: int, counters: Counters, api_key: str | None
) -> None:
    rng = random.Random(seed)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    while time.monotonic() < deadline:
        path, body = request_body(rng)
        cancel_after = rng.randint(1, 5) if body.get("stream") and rng.random() < 0.2 else None
        conn = http.client.HTTPConnection(host, port, timeout=300)
        try:
            conn.request("POST", path, json.dumps(body), headers)
            response = conn.getresponse()
            if response.status != 200:
                counters.add_status(response.status, response.read(), may_be_refused(body))
                if response.status == 503:
                    time.sleep(1.0)
                continue
            if not body.get("stream"):
                usage = json.loads(response.read()).get("usage") or {}
                counters.add("ok", usage.get("completion_tokens", usage.get("output_tokens", 0)))
                continue
            _read_stream(response, cancel_after, counters, path == "/v1/responses")
        except (OSError, http.client.HTTPException) as exc:
            counters.add("failed", error=repr(exc))
            time.sleep(0.5)
        finally:
            conn.close()


def _read_stream(
    response: http.client.HTTPResponse,
    cancel_after: int | None,
    counters: Counters,
    responses_api: bool,
) -> None:
    """One stream to its end: served at ``[DONE]``, or at a Responses stream's last event
    (completed or incomplete); failed at an error event or an early end."""
    events = 0
    for line in response:
        if not line.startswith(b"data: "):
            continue
        events += 1
        if cancel_after is not None and events >= cancel_after:
            counters.add("cancelled")
            return
        if line.strip() == b"data: [DONE]":
            counters.add("ok", max(events - 2, 0))
            return
        event = json.loads(line[len(b"data: ") :])
        if "error" in event or event.get("type") == "error":
            counters.add("failed", error=line[:200].decode(errors="replace"))
            return
        if responses_api and event["type"] in ("response.completed", "response.incomplete"):
            counters.add("ok", event["response"]["usage"]["output_tokens"])
            return
    counters.add("failed", error="a stream ended before its last event")
