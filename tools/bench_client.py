"""A streaming OpenAI client for the benchmarks, and the metrics of a load run.

Every request is streamed (SSE). On /v1/completions the prompts are token ids, so that the
prompt length is exact and no tokenizer is needed on the client; on /v1/chat/completions a
prompt is one user message of text (its length is the usage's ``prompt_tokens``), and the
reasoning a model writes counts as text. Times come from ``time.perf_counter`` on arrival of each
chunk that carries text:

- TTFT: request sent to first text chunk.
- ITL: the gaps between successive text chunks (a chunk may hold more than one token when the
  detokenizer holds back an incomplete UTF-8 character).
- TPOT: (latency - TTFT) / (output tokens - 1), per request; output tokens come from the
  usage the server reports at the end of the stream.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from tools.bench_common import summarize

T = TypeVar("T")


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    start: float = 0.0  # perf_counter when sent
    ttft: float = math.nan  # seconds
    latency: float = math.nan  # seconds, sent to last byte
    itl: list[float] = field(default_factory=list)  # seconds between text chunks
    error: str | None = None

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2 or math.isnan(self.ttft):
            return math.nan
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed: a client parsing hundreds of streams
    must keep up with the server, or its own lag shows up as inter-token latency."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def served_model(base_url: str, timeout: float = 10.0) -> tuple[str, str | None]:
    """The first model the server lists: its id, and its checkpoint path ("root") if given."""
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout) as resp:
        data = json.loads(resp.read())["data"][0]
    return data["id"], data.get("root")


def clamp_vocab_range(vocab_range: Sequence[int], model_path: str | None) -> tuple[int, int]:
    """``vocab_range`` cut to the model's vocabulary, when its config.json is readable here."""
    low, high = int(vocab_range[0]), int(vocab_range[1])
    config = os.path.join(model_path, "config.json") if model_path else ""
    if config and os.path.isfile(config):
        with open(config) as f:
            hf = json.load(f)
        vocab = (hf.get("text_config") or hf).get("vocab_size") or high
        high = min(high, vocab)
        low = min(low, high - 1)
    if not 0 <= low < high:
        raise ValueError(f"empty token id range [{low}, {high})")
    return low, high


def random_token_prompts(
    lengths: Sequence[int], vocab_range: tuple[int, int], seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    low, high = vocab_range
    return [[rng.randrange(low, high) for _ in range(n)] for n in lengths]


def uniform_lengths(n: int, mean: int, range_ratio: float, seed: int) -> list[int]:
    """``n`` lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    rng = random.Random(seed)
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    ignore_eos: bool = True,
    extra: dict[str, Any] | None = None,
) -> RequestResult:
    """One streamed request: a completion of token ids, or a chat turn of text."""
    chat = isinstance(prompt, str)
    body = {
        "model": model,
        **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    # A field set to None is left out: the server's default applies.
    body = {name: value for name, value in body.items() if value is not None}
    result = RequestResult(ok=False, prompt_len=0 if chat else len(prompt))
    result.start = time.perf_counter()
    last = result.start
    chunks = 0
    usage_tokens: int | None = None
    try:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with session.post(base_url.rstrip("/") + path, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                now = time.perf_counter()
                choices = chunk.get("choices") or []
                if choices and _has_text(choices[0]):
                    if chunks == 0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    if chat:
                        result.prompt_len = chunk["usage"].get("prompt_tokens", 0)
        result.latency = time.perf_counter() - result.start
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
        result.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is None:
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def run_load(
    base_url: str,
    model: str,
    prompts: Sequence[list[int] | str],
    output_lens: Sequence[int],
    request_rate: float = math.inf,
    concurrency: int | None = None,
    ignore_eos: bool = True,
    seed: int = 0,
    max_duration: float = math.inf,
    request_timeout: float = 600.0,
    on_done: Callable[[RequestResult], None] | None = None,
    sampling: Sequence[dict[str, Any]] = (),
) -> tuple[list[RequestResult], float]:
    """Send every prompt, Poisson-spaced at ``request_rate`` (inf: all at once), at most
    ``concurrency`` in flight. Stops sending at ``max_duration`` and cancels what is still
    running then. Request ``i`` takes the fields of ``sampling[i % len(sampling)]`` (none:
    greedy). Returns the results and the wall time of the run."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency) if concurrency else None
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore bounds concurrency, not this
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    results: list[RequestResult] = []

    async def one(
        session: aiohttp.ClientSession, prompt: list[int] | str, max_tokens: int, extra: Any
    ) -> None:
        if limit is not None:
            async with limit:
                result = await stream_completion(
                    session, base_url, model, prompt, max_tokens, ignore_eos, extra
                )
        else:
            result = await stream_completion(
                session, base_url, model, prompt, max_tokens, ignore_eos, extra
            )
        results.append(result)
        if on_done is not None:
            on_done(result)

    started = time.perf_counter()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for i, (prompt, max_tokens) in enumerate(zip(prompts, output_lens)):
            if time.perf_counter() - started >= max_duration:
                break
            extra = sampling[i % len(sampling)] if sampling else None
            tasks.append(asyncio.ensure_future(one(session, prompt, max_tokens, extra)))
            if math.isfinite(request_rate) and request_rate > 0:
                # Never past the time limit: the wait would extend the run beyond it.
                left = max_duration - (time.perf_counter() - started)
                await asyncio.sleep(min(rng.expovariate(request_rate), max(left, 0.0)))
        remaining = max_duration - (time.perf_counter() - started)
        if tasks:
            done, pending = await asyncio.wait(
                tasks, timeout=remaining if math.isfinite(remaining) else None
            )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
                unfinished = len(pending)
                results.extend(
                    RequestResult(ok=False, prompt_len=0, error="time limit reached")
                    for _ in range(unfinished)
                )
    return results, time.perf_counter() - started


def aggregate(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """The `vllm bench serve` style summary: throughput and TTFT/TPOT/ITL/E2E percentiles (ms)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_len for r in ok)
    itl = [gap for r in ok for gap in r.itl]
    errors = sorted({r.error for r in results if not r.ok and r.error})
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors[:5],
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": output_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0
        else math.nan,
        # Little's law: the mean number of requests in the system.
        "mean_concurrency": sum(r.latency for r in ok) / duration if duration > 0 else math.nan,
        "ttft_ms": summarize([r.ttft for r in ok if not math.isnan(r.ttft)], 1e3),
        "tpot_ms": summarize([r.tpot for r in ok if not math.isnan(r.tpot)], 1e3),
        "itl_ms": summarize(itl, 1e3),
        "e2el_ms": summarize([r.latency for r in ok], 1e3),
    }
