"""POST /v1/chat/completions: the same fan-out as completions, over one conversation
rendered n times; answers ``chat.completion`` or an SSE stream of ``chat.completion.chunk``."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from frontend_proc.chat_output import ChatOutput
from frontend_proc.fanout import FanOut
from frontend_proc.logprobs import chat_logprobs, prompt_logprobs_field
from frontend_proc.schemas import ChatCompletionRequest, parse_chat_request
from frontend_proc.serving_common import (
    ChoiceState,
    ServingContext,
    StreamWriter,
    chunk_usage,
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
            tools=request.tools,
            continue_final_message=request.continue_final_message,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            add_special_tokens=request.add_special_tokens,
        )
        for k in range(request.n)
    ]


async def create_chat_completion(
    http_request: web.Request, ctx: ServingContext, body: Any
) -> web.StreamResponse:
    request = parse_chat_request(
        body, ctx.served_model_names, ctx.sampling_defaults, ctx.max_logprobs
    )
    request_id = new_request_id("chatcmpl")
    created = int(time.time())
    subs = build_sub_requests(request_id, request)
    states = [ChoiceState() for _ in subs]

    num_top = request.top_logprobs or 0

    output = ChatOutput(request, ctx.reasoning)

    if not request.stream:
        async with FanOut(ctx.engine, subs) as fan:
            await collect(fan, states)
        choices = [
            {
                "index": index,
                # First: it may make the finish "tool_calls".
                "message": output.message(state),
                "logprobs": (
                    chat_logprobs(state.logprobs, num_top, request.return_tokens_as_token_ids)
                    if request.logprobs
                    else None
                ),
                "finish_reason": state.finish_reason,
                "stop_reason": state.stop_reason,
            }
            for index, state in enumerate(states)
        ]
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": request.model,
            "choices": choices,
            "usage": usage(states, request.n),
        }
        if request.prompt_logprobs is not None:
            # Every choice has the same prompt: the response carries its logprobs once.
            body["prompt_logprobs"] = prompt_logprobs_field(
                states[0].prompt_logprobs.ordered(), request.prompt_logprobs
            )
        return json_response(body)

    header = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": request.model,
    }

    def chunk(
        index: int,
        counts: tuple[int, int],
        delta: dict[str, Any],
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``counts``: the choice's prompt and completion tokens so far."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        usage_field = chunk_usage(request.include_usage, request.continuous_usage, *counts)
        return {**header, "choices": [choice], **usage_field}

    def preamble(first: TextDelta | None) -> list[dict[str, Any]]:
        # Every choice has the same prompt: the first delta tells its length.
        counts = (0 if first is None else first.prompt_tokens, 0)
        role = {"role": "assistant", "content": ""}
        return [chunk(index, counts, role) for index in range(len(subs))]

    streams = [output.stream() for _ in subs]

    def chunk_for(index: int, delta: TextDelta, state: ChoiceState) -> list[dict[str, Any]]:
        fields = streams[index].fields(delta)
        logprobs = (
            chat_logprobs(state.new_logprobs, num_top, request.return_tokens_as_token_ids)
            if request.logprobs and state.new_logprobs
            else None
        )
        counts = (state.prompt_tokens, state.completion_tokens)
        if delta.finish_reason is not None:
            reason = streams[index].finish_reason(state)
            return [chunk(index, counts, fields, reason, state.stop_reason, logprobs)]
        if not fields and logprobs is None:
            return []
        return [chunk(index, counts, fields, logprobs=logprobs)]

    def final() -> list[dict[str, Any]]:
        if not request.include_usage:
            return []
        return [{**header, "choices": [], "usage": usage(states, request.n)}]

    async with FanOut(ctx.engine, subs) as fan:
        writer = StreamWriter(http_request, fan, states, chunk_for, preamble, final)
        return await writer.run()
