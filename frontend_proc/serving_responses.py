"""POST /v1/responses: OpenAI's Responses API over the chat pipeline. One answer (a response
has no ``n``), returned as a ``response`` object, or streamed as its events (``event:`` and
``data:`` lines, from ``response.created`` to ``response.completed``)."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from frontend_proc import jsonutil
from frontend_proc.chat_output import ChatOutput
from frontend_proc.errors import APIError
from frontend_proc.fanout import FanOut
from frontend_proc.logprobs import TokenEntry, chat_logprobs
from frontend_proc.reasoning import ReasoningTokenCounter
from frontend_proc.response_items import ResponseItems, item_id
from frontend_proc.responses_request import ResponsesRequest, parse_responses_request
from frontend_proc.serving_chat import build_sub_requests
from frontend_proc.serving_common import (
    ChoiceState,
    ServingContext,
    StreamWriter,
    json_response,
)
from pegainfer.protocol import TextDelta


class _Answer:
    """What one response has produced so far."""

    def __init__(self, request: ResponsesRequest, response_id: str, ctx: ServingContext) -> None:
        self.request = request
        self.ctx = ctx
        self.response_id = response_id
        self.created_at = int(time.time())
        self.state = ChoiceState()
        self.items = ResponseItems()
        self.reasoning_tokens = ReasoningTokenCounter() if ctx.reasoning else None

    def count(self, delta: TextDelta) -> None:
        if self.reasoning_tokens is not None:
            num_tokens = len(delta.token_ids) // 4
            self.reasoning_tokens.add(delta.text, num_tokens, delta.starts_in_reasoning)

    @property
    def incomplete(self) -> bool:
        return self.state.finish_reason == "length"

    def body(self, status: str | None = None) -> dict[str, Any]:
        """The response object; ``status`` while it is still being written."""
        state = self.state
        if status is None:
            status = "incomplete" if self.incomplete else "completed"
        finished = status in ("completed", "incomplete")
        reasoning_tokens = self.reasoning_tokens.count if self.reasoning_tokens else 0
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if finished else None,
            "status": status,
            "error": None,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self.request.chat.model,
            "output": self.items.items if finished else [],
            "usage": {
                "input_tokens": state.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": state.cached_tokens,
                    "cache_write_tokens": self.ctx.cache_write_tokens(
                        state.prompt_tokens, state.cached_tokens
                    ),
                },
                "output_tokens": state.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": state.prompt_tokens + state.completion_tokens,
            }
            if finished
            else None,
            **self.request.echo,
        }


async def create_response(
    http_request: web.Request, ctx: ServingContext, body: Any
) -> web.StreamResponse:
    request = parse_responses_request(
        body, ctx.served_model_names, ctx.sampling_defaults, ctx.max_logprobs
    )
    answer = _Answer(request, item_id("resp"), ctx)
    subs = build_sub_requests(answer.response_id, request.chat)
    output = ChatOutput(request.chat, ctx.reasoning)
    content_tokens = output.content_tokens() if request.logprobs is not None else None

    def content_logprobs(
        entries: list[TokenEntry], starts_in_reasoning: bool, last: bool
    ) -> list[Any]:
        """The logprobs of the tokens, of these and of those that waited, that write the
        message's text (``last``: the output's last tokens)."""
        if content_tokens is None:
            return []
        if starts_in_reasoning:
            content_tokens.start_in_reasoning()
        chosen = content_tokens.take([e for e in entries if e.logprob is not None])
        if last:
            chosen += content_tokens.flush()
        return chat_logprobs(chosen, request.logprobs or 0)["content"]

    if not request.stream:
        async with FanOut(ctx.engine, subs) as fan:
            async for _, delta in fan:
                answer.state.update(delta)
                answer.count(delta)
        state = answer.state
        logprobs = content_logprobs(state.logprobs, state.starts_in_reasoning, True)
        answer.items.message(output.message(state), logprobs)
        answer.items.close(answer.incomplete)
        return json_response(answer.body())

    stream = output.stream()

    def preamble(first: TextDelta | None) -> list[dict[str, Any]]:
        return [
            {"type": "response.created", "response": answer.body("in_progress")},
            {"type": "response.in_progress", "response": answer.body("in_progress")},
        ]

    def events_for(index: int, delta: TextDelta, state: ChoiceState) -> list[dict[str, Any]]:
        answer.count(delta)
        finished = delta.finish_reason is not None
        logprobs = content_logprobs(state.new_logprobs, delta.starts_in_reasoning, finished)
        answer.items.chat_fields(stream.fields(delta), logprobs)
        if delta.finish_reason is not None:
            answer.items.close(answer.incomplete)
            kind = "response.incomplete" if answer.incomplete else "response.completed"
            answer.items.events.append({"type": kind, "response": answer.body()})
        events, answer.items.events = answer.items.events, []
        return events

    async with FanOut(ctx.engine, subs) as fan:
        writer = StreamWriter(
            http_request,
            fan,
            [answer.state],
            events_for,
            preamble,
            encode=_EventEncoder(),
            done=b"",
        )
        return await writer.run()


class _EventEncoder:
    """Each event as ``event: <type>`` and its ``data:``, numbered in order; an error body
    (a stream that fails) becomes an ``error`` event."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, event: dict[str, Any]) -> bytes:
        if "type" not in event and isinstance(event.get("error"), dict):
            error = event["error"]
            event = {
                "type": "error",
                "code": error.get("code") or error.get("type"),
                "message": error.get("message"),
                "param": error.get("param"),
            }
        event = {**event, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return b"event: " + event["type"].encode() + b"\ndata: " + jsonutil.dumps(event) + b"\n\n"


def stored_response(response_id: str) -> APIError:
    """GET /v1/responses/{id}: nothing is stored, so every id is unknown."""
    return APIError(
        404,
        f"no response {json.dumps(response_id)}: responses are not stored here",
        "invalid_request_error",
        "response_id",
        "not_found",
    )
