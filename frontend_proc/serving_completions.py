"""POST /v1/completions: fan a batch of prompts times n out to the engine, and answer with one
``text_completion`` body or an SSE stream of chunks."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from frontend_proc.engine_extras import truncate_prompt
from frontend_proc.fanout import FanOut
from frontend_proc.fields import check_sampling_token_ids, check_token_ids
from frontend_proc.limits import resolve_max_tokens
from frontend_proc.logprobs import (
    TokenEntry,
    completion_logprobs,
    entries,
    prompt_logprobs_field,
)
from frontend_proc.schemas import CompletionRequest, parse_completion_request
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
from pegainfer.protocol import (
    GenerateRequest,
    SamplingParams,
    TextDelta,
    TokenizedRequest,
    unpack_ids,
)


def build_sub_requests(
    request_id: str, request: CompletionRequest, ctx: ServingContext
) -> list[GenerateRequest | TokenizedRequest]:
    """One request per prompt and choice. Token-id prompts are checked here when the
    vocabulary is known, and skip the tokenizer; text goes to a tokenizer."""
    arrival_time = time.time()
    subs: list[GenerateRequest | TokenizedRequest] = []
    for prompt_index, prompt in enumerate(request.prompts):
        # Bad words need a tokenizer.
        direct = (
            isinstance(prompt, bytes)
            and ctx.vocab_size is not None
            and not request.sampling.bad_words
        )
        sampling = request.sampling
        if direct:
            prompt, sampling = checked_id_prompt(prompt, request, ctx)
        for k in range(request.n):
            sub_id = sub_request_id(request_id, prompt_index * request.n + k)
            # Echoed logprobs come with each choice's own stream.
            per_choice = request.echo and request.logprobs is not None
            choice_sampling = sampling_for_choice(sampling, k, per_choice)
            if direct:
                subs.append(TokenizedRequest(sub_id, prompt, choice_sampling, arrival_time))
                continue
            is_text = isinstance(prompt, str)
            subs.append(
                GenerateRequest(
                    request_id=sub_id,
                    prompt=prompt if is_text else None,
                    prompt_token_ids=None if is_text else prompt,
                    messages=None,
                    chat_template_kwargs={},
                    add_generation_prompt=False,
                    sampling=choice_sampling,
                    arrival_time=arrival_time,
                    truncate_prompt_tokens=request.truncate_prompt_tokens,
                    add_special_tokens=request.add_special_tokens,
                )
            )
    return subs


def checked_id_prompt(
    prompt: bytes, request: CompletionRequest, ctx: ServingContext
) -> tuple[bytes, SamplingParams]:
    """What a tokenizer process does to a token-id prompt (every id names a token, and so
    does every stop token id; truncation; the prompt fits the context window), here;
    returns the prompt and the sampling settings with ``max_tokens`` resolved. Raises
    APIError (400)."""
    check_sampling_token_ids(request.sampling, ctx.vocab_size)
    ids = unpack_ids(prompt)
    # The parse left no negative id, so one pass for the largest will do; the full check
    # then names the offender.
    if max(ids) >= ctx.vocab_size:
        check_token_ids(ids, ctx.vocab_size, "prompt")
    prompt = truncate_prompt(prompt, request.truncate_prompt_tokens, ctx.max_model_len)
    sampling = resolve_max_tokens(len(prompt) // 4, request.sampling, ctx.max_model_len, False)
    return prompt, sampling


def _echo_prefix(request: CompletionRequest, index: int) -> str:
    if not request.echo:
        return ""
    prompt = request.prompts[index // request.n]
    return prompt if isinstance(prompt, str) else ""


def _choice(
    index: int, text: str, state: ChoiceState, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": state.finish_reason,
        "stop_reason": state.stop_reason,
    }


def _all_logprobs(request: CompletionRequest, state: ChoiceState) -> dict[str, Any] | None:
    if request.logprobs is None:
        return None
    tokens: list[TokenEntry] = []
    if request.echo:
        tokens.extend(state.prompt_logprobs.ordered())
    tokens.extend(state.logprobs)
    return completion_logprobs(tokens, request.logprobs, 0, request.return_tokens_as_token_ids)


async def create_completion(
    http_request: web.Request, ctx: ServingContext, body: Any
) -> web.StreamResponse:
    request = parse_completion_request(
        body, ctx.served_model_names, ctx.sampling_defaults, ctx.max_logprobs
    )
    request_id = new_request_id("cmpl")
    created = int(time.time())
    subs = build_sub_requests(request_id, request, ctx)
    states = [ChoiceState() for _ in subs]
    header = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": request.model,
    }

    if not request.stream:
        async with FanOut(ctx.engine, subs) as fan:
            await collect(fan, states)
        choices = [
            _choice(
                index,
                _echo_prefix(request, index) + state.text,
                state,
                _all_logprobs(request, state),
            )
            for index, state in enumerate(states)
        ]
        if request.return_token_ids:
            # An extension: the generated token ids of each choice, for exact comparisons.
            for choice, state in zip(choices, states):
                choice["token_ids"] = state.token_ids
        if request.prompt_logprobs is not None:
            for index, choice in enumerate(choices):
                # The first choice of each prompt computed them (sampling_for_choice).
                first = states[index - index % request.n]
                choice["prompt_logprobs"] = prompt_logprobs_field(
                    first.prompt_logprobs.ordered(), request.prompt_logprobs
                )
        return json_response({**header, "choices": choices, "usage": usage(states, request.n)})

    def chunk(choice: dict[str, Any], state: ChoiceState) -> dict[str, Any]:
        counts = chunk_usage(
            request.include_usage,
            request.continuous_usage,
            state.prompt_tokens,
            state.completion_tokens,
        )
        return {**header, "choices": [choice], **counts}

    # Each choice's first chunk starts with its prompt, under echo.
    echo_pending = [request.echo] * len(subs)

    # Where each choice's next logprob token starts in its streamed text.
    text_offsets = [0] * len(subs)

    def chunk_logprobs(index: int, delta: TextDelta, state: ChoiceState) -> dict | None:
        if request.logprobs is None:
            return None
        tokens: list[TokenEntry] = []
        if request.echo:
            tokens.extend(entries(delta.prompt_logprobs))
        tokens.extend(state.new_logprobs)
        if not tokens:
            return None
        result = completion_logprobs(
            tokens, request.logprobs, text_offsets[index], request.return_tokens_as_token_ids
        )
        text_offsets[index] += sum(len(entry.text) for entry in tokens)
        return result

    def chunk_for(index: int, delta: TextDelta, state: ChoiceState) -> list[dict[str, Any]]:
        logprobs = chunk_logprobs(index, delta, state)
        text = delta.text
        if echo_pending[index]:
            echo_pending[index] = False
            text = _echo_prefix(request, index) + text
        # An empty delta carries nothing unless it ends the choice or has logprobs.
        if not text and delta.finish_reason is None and logprobs is None:
            return []
        finished = delta.finish_reason is not None
        choice = _choice(index, text, state if finished else ChoiceState(), logprobs)
        return [chunk(choice, state)]

    def final() -> list[dict[str, Any]]:
        if not request.include_usage:
            return []
        return [{**header, "choices": [], "usage": usage(states, request.n)}]

    async with FanOut(ctx.engine, subs) as fan:
        writer = StreamWriter(http_request, fan, states, chunk_for, final=final)
        return await writer.run()
