"""Admission: the checks a request must pass before it may wait for the KV cache, and what
its first step takes when it leaves the waiting queue.

The tokenizer has validated the request against the model already; these checks cover what
only the scheduler knows (the size of the KV cache, the ids in use) and guard against a
malformed message.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from pegainfer.protocol import ProtocolError, RequestRejected, TokenizedRequest, unpack_ids_array
from scheduler_proc.block_manager import BlockManager, blocks_for_tokens
from scheduler_proc.prefix_cache import PrefixCache, PrefixNode
from scheduler_proc.request import Request

logger = logging.getLogger(__name__)

_INVALID_REQUEST = "invalid_request_error"


def check_admission(
    tokenized: TokenizedRequest,
    ids_in_use: set[str] | dict[str, object],
    max_model_len: int,
    num_blocks: int,
    block_size: int,
) -> array | RequestRejected:
    """The request's prompt token ids, or why it is refused (a 400)."""
    request_id = tokenized.request_id
    sampling = tokenized.sampling
    try:
        prompt = prompt_ids(tokenized.prompt_token_ids)
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


def prompt_ids(packed: bytes) -> array:
    """Packed int32 ids as an int32 array. A list would hold an int object per token,
    thousands for a long prompt, to make on arrival and free at the end, and for the garbage
    collector to walk while the request lives."""
    return unpack_ids_array(packed)


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


def turn_away(request_id: str, message: str, code: str) -> RequestRejected:
    """A 503: the request may be fine, the server cannot take it now."""
    logger.warning("turned away request %s: %s", request_id, message)
    return RequestRejected(
        request_id=request_id,
        status=503,
        message=message,
        error_type="server_error",
        param=None,
        code=code,
    )


@dataclass
class AdmissionPlan:
    """How a waiting request starts: on the cached blocks of its longest cached prefix
    (``hits``), computing ``num_new`` tokens after them in ``num_blocks`` new blocks."""

    hits: list[PrefixNode]
    hit_blocks: list[int]
    num_new: int
    num_blocks: int
    num_cached: int  # tokens in the hit blocks (they are full)


def plan_admission(
    request: Request,
    budget: int,
    block_manager: BlockManager,
    prefix_cache: PrefixCache | None,
) -> AdmissionPlan | None:
    """The waiting request's first step within ``budget`` tokens, or None if the KV cache
    cannot take it now."""
    # Prompt logprobs need every prompt position computed, so no cache hits.
    use_cache = prefix_cache is not None and request.sampling.prompt_logprobs is None
    hits = prefix_cache.match(request) if use_cache else []
    hit_blocks = PrefixCache.blocks_of(hits)
    num_cached = len(hits) * block_manager.block_size
    num_new = min(request.num_tokens - num_cached, budget)
    num_blocks = block_manager.blocks_for_tokens(num_cached + num_new) - len(hits)
    # Taking a cached hit block back removes it from the free count, too.
    if not block_manager.can_allocate(num_blocks + block_manager.num_unreferenced(hit_blocks)):
        return None
    return AdmissionPlan(hits, hit_blocks, num_new, num_blocks, num_cached)


class EarlyAborts:
    """Ids aborted before their request arrived (the abort overtook it on the way through a
    tokenizer); that request is dropped when it does arrive. Oldest first, bounded."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def remember(self, request_id: str) -> None:
        self._ids[request_id] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def consume(self, request_id: str) -> bool:
        """Whether this id was aborted early (it is forgotten then)."""
        if request_id not in self._ids:
            return False
        del self._ids[request_id]
        return True
