"""POST /v1/chat/completions: the same fan-out as completions, over one conversation
rendered n times; answers ``chat.completion`` or an SSE stream of ``chat.completion.chunk``."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from frontend_proc.fanout import FanOut
from frontend_proc.schemas import ChatCompletionRequest, parse_chat_request
from frontend_proc.serving_common import (
    ChoiceState,
    ServingContext,
    StreamWriter,
    collect,
    json_response,
    new_request_id,
    sampling_for_choice,
    sub_request_id,
    usage,
)
from pegainfer.protocol import GenerateRequest, TextDelta


def build_sub_requests(request_id: str, request: ChatCompletionRequest) -> list[GenerateRequest]:
    arrival_time = time.time()
    return [
        GenerateRequest(
            request_id=sub_request_id(request_id, k),
            prompt=None,
            prompt_token_ids=None,
            messages=request.messages,
            chat_template_kwargs=request.chat_template_kwargs,
            add_generation_prompt=request.add_generation_prompt,
            sampling=sampling_for_choice(request.sampling, k),
            arrival_time=arrival_time,
        )
        for k in range(request.n)
    ]


async def create_chat_completion(
    http_request: web.Request, ctx: ServingContext, body: Any
) -> web.StreamResponse:
    request = parse_chat_request(body, ctx.served_model_name)
    request_id = new_request_id("chatcmpl")
    created = int(time.time())
    subs = build_sub_requests(request_id, request)
    states = [ChoiceState() for _ in subs]

    if not request.stream:
        async with FanOut(ctx.engine, subs) as fan:
            await collect(fan, states)
        choices = [
            {
                "index": index,
                "message": {"role": "assistant", "content": state.text, "reasoning_content": None},
                "logprobs": None,
                "finish_reason": state.finish_reason,
                "stop_reason": state.stop_reason,
            }
            for index, state in enumerate(states)
        ]
        return json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": request.model,
                "choices": choices,
                "usage": usage(states, request.n),
            }
        )

    header = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": request.model,
    }
    usage_field = {"usage": None} if request.include_usage else {}

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        return {**header, "choices": [choice], **usage_field}

    def preamble() -> list[dict[str, Any]]:
        return [chunk(index, {"role": "assistant", "content": ""}) for index in range(len(subs))]

    def chunk_for(index: int, delta: TextDelta, state: ChoiceState) -> list[dict[str, Any]]:
        if delta.finish_reason is not None:
            content = {"content": delta.text} if delta.text else {}
            return [chunk(index, content, state.finish_reason, state.stop_reason)]
        if not delta.text:
            return []
        return [chunk(index, {"content": delta.text})]

    def final() -> list[dict[str, Any]]:
        if not request.include_usage:
            return []
        return [{**header, "choices": [], "usage": usage(states, request.n)}]

    async with FanOut(ctx.engine, subs) as fan:
        writer = StreamWriter(http_request, fan, states, chunk_for, preamble, final)
        return await writer.run()
