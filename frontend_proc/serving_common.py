"""What the completion and chat endpoints share: sub-request fan-out, per-choice state,
usage arithmetic and the SSE stream driver."""

from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from frontend_proc import jsonutil
from frontend_proc.engine_client import EngineClientProtocol
from frontend_proc.errors import SERVER_ERROR, APIError
from frontend_proc.fanout import FanOut
from frontend_proc.logprobs import PromptLogprobs, TokenEntry, entries
from frontend_proc.sampling_defaults import SamplingDefaults
from pegainfer.protocol import SamplingParams, TextDelta, unpack_ids

logger = logging.getLogger(__name__)

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # proxies must not hold tokens back
}
DONE = b"data: [DONE]\n\n"


class EventStreamResponse(web.StreamResponse):
    """An SSE response whose status line and headers leave with its first event, in one
    write to the socket instead of two, so the first token reaches the client sooner. The
    aiohttp versions that can hold headers back read this attribute; others send them at
    once, as before. The bytes on the wire are the same either way."""

    _send_headers_immediately = False


@dataclass
class ServingContext:
    served_model_name: str
    model_path: str
    max_model_len: int
    engine: EngineClientProtocol
    created: int = field(default_factory=lambda: int(time.time()))
    reasoning: bool = False  # split <think> blocks into reasoning_content
    vocab_size: int | None = None  # the model's, when the config names it
    # What a request's omitted sampling fields become (--generation-config).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # The prefix cache's block, in tokens; 0 without a prefix cache.
    cache_block_size: int = 0
    model_aliases: tuple[str, ...] = ()  # other names requests may use
    max_logprobs: int = 20  # top logprobs a token may ask for (--max-logprobs; -1: all)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the model answers to, the one responses default to first."""
        return (self.served_model_name, *self.model_aliases)

    def cache_write_tokens(self, prompt_tokens: int, cached_tokens: int) -> int:
        """The prompt tokens a request adds to the prefix cache: the full blocks it computed."""
        if self.cache_block_size <= 0:
            return 0
        full = prompt_tokens // self.cache_block_size * self.cache_block_size
        return max(0, full - cached_tokens)


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenEntry] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs = field(default_factory=PromptLogprobs)
    # The logprob entries the latest delta brought, for a streamed chunk.
    new_logprobs: list[TokenEntry] = field(default_factory=list)
    # The prompt opened a think block: the output starts as reasoning.
    starts_in_reasoning: bool = False

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def update(self, delta: TextDelta) -> None:
        if delta.starts_in_reasoning:
            self.starts_in_reasoning = True
        if delta.text:
            self.text_parts.append(delta.text)
        if delta.token_ids:
            self.token_ids.extend(unpack_ids(delta.token_ids))
        self.new_logprobs = entries(delta.logprobs)
        self.logprobs.extend(self.new_logprobs)
        self.prompt_logprobs.add(delta.prompt_logprobs)
        # Token counts on a delta are running totals.
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = delta.completion_tokens
        self.cached_tokens = delta.cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sub_request_id(request_id: str, choice_index: int) -> str:
    return f"{request_id}-{choice_index}"


def sampling_for_choice(
    sampling: SamplingParams, k: int, prompt_logprobs_per_choice: bool = False
) -> SamplingParams:
    """The k-th of n samples of one prompt. A seeded request gets distinct but reproducible
    seeds, or its n choices would all be the same text. The prompt's logprobs are the same
    for every choice: only the first computes them, unless each streams its own."""
    if k == 0:
        return sampling
    drop_prompt_logprobs = sampling.prompt_logprobs is not None and not prompt_logprobs_per_choice
    if sampling.seed is None and not drop_prompt_logprobs:
        return sampling
    child = copy.copy(sampling)
    if sampling.seed is not None:
        child.seed = (sampling.seed + k + 2**63) % 2**64 - 2**63
    if drop_prompt_logprobs:
        child.prompt_logprobs = None
    return child


def usage(states: list[ChoiceState], n: int) -> dict[str, Any]:
    """OpenAI counts each prompt once, however many choices were sampled from it."""
    prompt_tokens = sum(states[start].prompt_tokens for start in range(0, len(states), n))
    cached_tokens = sum(states[start].cached_tokens for start in range(0, len(states), n))
    completion_tokens = sum(state.completion_tokens for state in states)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chunk_usage(
    include_usage: bool, continuous: bool, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A stream chunk's ``usage`` field: none unless the stream asked for usage; then null,
    or with vLLM's ``continuous_usage_stats`` the choice's token counts so far."""
    if not include_usage:
        return {}
    if not continuous:
        return {"usage": None}
    return {
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    }


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(body=jsonutil.dumps(body), status=status, content_type="application/json")


def sse_event(body: dict[str, Any]) -> bytes:
    return b"data: " + jsonutil.dumps(body) + b"\n\n"


async def collect(fan: FanOut, states: list[ChoiceState]) -> None:
    async for index, delta in fan:
        states[index].update(delta)


class StreamWriter:
    """Drives one SSE response: chunks, an error event if something fails after the stream
    started, and the closing [DONE]. The response status is chosen only once the first event
    is in, so that a request rejected before producing anything still gets its 4xx."""

    def __init__(
        self,
        http_request: web.Request,
        fan: FanOut,
        states: list[ChoiceState],
        chunk_for: Callable[[int, TextDelta, ChoiceState], list[dict[str, Any]]],
        preamble: Callable[[TextDelta | None], list[dict[str, Any]]] = lambda first: [],
        final: Callable[[], list[dict[str, Any]]] = list,
        encode: Callable[[dict[str, Any]], bytes] | None = None,
        done: bytes = DONE,
    ) -> None:
        """``encode``: one event's bytes (``sse_event`` by default; it also gets the error
        body of a stream that fails); ``done``: the stream's last bytes."""
        self.http_request = http_request
        self.fan = fan
        self.states = states
        self.chunk_for = chunk_for
        self.preamble = preamble
        self.final = final
        self.encode = encode or sse_event
        self.done = done

    async def run(self) -> web.StreamResponse:
        events = aiter(self.fan)
        # A rejection here propagates and becomes an ordinary error response.
        first = await anext(events, None)
        response = EventStreamResponse(status=200, headers=SSE_HEADERS)
        await response.prepare(self.http_request)
        try:
            # The preamble may read the first delta (its prompt's length), not apply it.
            await self._write(response, self.preamble(None if first is None else first[1]))
            if first is not None:
                await self._deliver(response, *first)
                # Sends the headers, if the first event made no bytes to carry them.
                await response.write(b"")
                async for index, delta in events:
                    await self._deliver(response, index, delta)
            await self._write(response, self.final())
        except APIError as exc:
            await self._write_error(response, exc)
        except ConnectionResetError:
            logger.info("client went away during a stream")
            return response
        except Exception:
            logger.exception("a stream failed")
            await self._write_error(response, APIError(500, "internal server error", SERVER_ERROR))
        try:
            if self.done:
                await response.write(self.done)
            await response.write_eof()
        except ConnectionResetError:
            pass
        return response

    async def _deliver(self, response: web.StreamResponse, index: int, delta: TextDelta) -> None:
        state = self.states[index]
        state.update(delta)
        await self._write(response, self.chunk_for(index, delta, state))

    async def _write(self, response: web.StreamResponse, chunks: list[dict[str, Any]]) -> None:
        if chunks:
            await response.write(b"".join(self.encode(chunk) for chunk in chunks))

    async def _write_error(self, response: web.StreamResponse, exc: APIError) -> None:
        try:
            await response.write(self.encode(exc.body()))
        except ConnectionResetError:
            pass
