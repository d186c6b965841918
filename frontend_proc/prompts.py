"""The ``prompt`` field of a completion request: text, token ids, or a batch of either."""

from __future__ import annotations

from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import MAX_INT32, is_int

# One prompt: text to tokenize, or token ids to use as they are.
Prompt = str | list[int]

_SHAPE = "'prompt' must be a string, a list of strings, a list of token ids or a list of lists"


def _token_ids(value: list[Any]) -> list[int]:
    if not value:
        raise invalid("'prompt' holds an empty list of token ids", "prompt")
    # Long id prompts (a cached document, say) arrive often: check them in C (one pass for
    # the types, min and max for the range), and only walk them item by item to name an error.
    if set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= MAX_INT32:
        return list(value)
    for item in value:
        if not is_int(item):
            raise invalid(_SHAPE, "prompt")
        # The vocabulary bound is checked by the tokenizer process, which knows it; this one
        # only keeps ids packable as int32.
        if item < 0 or item > MAX_INT32:
            raise invalid(f"'prompt' holds token id {item}, which is out of range", "prompt")
    return list(value)


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
