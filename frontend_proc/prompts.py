"""The ``prompt`` field of a completion request: text, token ids, or a batch of either."""

from __future__ import annotations

import struct
from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import MAX_INT32, is_int
from pegainfer.protocol import pack_ids

# One prompt: text to tokenize, or token ids to use as they are, packed as they travel
# (little-endian int32, ``pegainfer.protocol.pack_ids``).
Prompt = str | bytes

# The last byte of a little-endian int32 that is not negative.
_NON_NEGATIVE_SIGN_BYTES = bytes(range(128))
_PACKED_ZERO, _PACKED_ONE = struct.pack("<i", 0), struct.pack("<i", 1)

_SHAPE = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists"


def _token_ids(value: list[Any]) -> bytes:
    if not value:
        raise invalid("'prompt' holds an empty list of token ids", "prompt")
    # Long id prompts (a cached document, say) arrive often, and every microsecond here is
    # time to first token: one C pass packs them, refusing non-integers and anything beyond
    # int32, and the sign bytes show negatives. struct takes a bool for 0 or 1, so the
    # types are looked at only when the bytes of a 0 or a 1 appear somewhere. Only a prompt
    # that fails is walked item by item, to name the error.
    try:
        packed = struct.pack(f"<{len(value)}i", *value)
    except struct.error:
        packed = b""
    if packed and not packed[3::4].translate(None, _NON_NEGATIVE_SIGN_BYTES):
        may_hold_bool = _PACKED_ZERO in packed or _PACKED_ONE in packed
        if not may_hold_bool or bool not in map(type, value):
            return packed
    for item in value:
        if not is_int(item):
            raise invalid(_SHAPE, "prompt")
        # The vocabulary bound is checked by the tokenizer process, which knows it; this one
        # only keeps ids packable as int32.
        if item < 0 or item > MAX_INT32:
            raise invalid(f"'prompt' holds token id {item}, which is out of range", "prompt")
    return pack_ids(value)


def parse_prompt(value: Any) -> list[Prompt]:
    """Normalize ``prompt`` to a non-empty batch of prompts."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise invalid(_SHAPE if not isinstance(value, list) else "'prompt' is empty", "prompt")
    first = value[0]
    if isinstance(first, str):
        if not all(isinstance(item, str) for item in value):
            raise invalid(_SHAPE, "prompt")
        return list(value)
    if is_int(first):
        return [_token_ids(value)]
    if isinstance(first, list):
        if not all(isinstance(item, list) for item in value):
            raise invalid(_SHAPE, "prompt")
        return [_token_ids(item) for item in value]
    raise invalid(_SHAPE, "prompt")
