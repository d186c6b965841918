"""Checks a request must pass before it may wait for the KV cache.

The tokenizer has validated the request against the model already; these checks cover what
only the scheduler knows (the size of the KV cache, the ids in use) and guard against a
malformed message.
"""

from __future__ import annotations

import logging

from pegainfer.protocol import ProtocolError, RequestRejected, TokenizedRequest, unpack_ids
from scheduler_proc.block_manager import blocks_for_tokens

logger = logging.getLogger(__name__)

_INVALID_REQUEST = "invalid_request_error"


def check_admission(
    tokenized: TokenizedRequest,
    ids_in_use: set[str] | dict[str, object],
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> list[int] | RequestRejected:
    """The request's prompt token ids, or why it is refused (a 400)."""
    request_id = tokenized.request_id
    sampling = tokenized.sampling
    try:
        prompt = unpack_ids(tokenized.prompt_token_ids)
    except ProtocolError as exc:
        return reject(request_id, f"malformed prompt token ids: {exc}", "prompt")
    if request_id in ids_in_use:
        return reject(request_id, f"request id {request_id!r} is already in use", None)
    if not prompt:
        return reject(request_id, "the prompt is empty", "prompt")
    if sampling.max_tokens < 1:
        return reject(request_id, "max_tokens must be at least 1", "max_tokens")
    if len(prompt) > max_model_len:
        return reject(
            request_id,
            f"the prompt has {len(prompt)} tokens, more than the maximum context length "
            f"of {max_model_len}",
            "prompt",
        )
    # It could never run if its longest possible sequence outgrows the whole cache.
    # Generation stops at max_model_len, so the cache never holds more than that.
    max_len = min(len(prompt) + sampling.max_tokens, max(max_model_len, len(prompt)))
    blocks_needed = blocks_for_tokens(max_len, block_size)
    if blocks_needed > num_blocks:
        return reject(
            request_id,
            f"the prompt ({len(prompt)} tokens) plus max_tokens ({sampling.max_tokens}) needs "
            f"{blocks_needed} KV cache blocks, but the cache has only {num_blocks} "
            f"({num_blocks * block_size} tokens); lower max_tokens or shorten the prompt",
            "max_tokens",
        )
    return prompt


def reject(request_id: str, message: str, param: str | None) -> RequestRejected:
    logger.info("rejected request %s: %s", request_id, message)
    return RequestRejected(
        request_id=request_id,
        status=400,
        message=message,
        error_type=_INVALID_REQUEST,
        param=param,
        code=None,
    )
