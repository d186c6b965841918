"""vLLM's request extensions that reach past the sampler: ``allowed_token_ids``,
``bad_words``, ``truncate_prompt_tokens``, ``cache_salt`` and ``priority`` (which the
scheduler refuses unless the server schedules by priority).

``bad_words`` are strings the output may never write as the tokenizer writes them, at the
text's start or after a space (scheduler_proc/bad_words.py applies them).

``truncate_prompt_tokens`` keeps the last k tokens of the prompt (of the rendered
conversation, for chat); -1 keeps the last ``max_model_len``. ``cache_salt`` keeps a
request's prefix-cache blocks to requests of the same salt, so that tenants cannot learn
each other's prompts from time to first token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import MAX_INT32, get_int, get_int_list, get_str

MAX_BAD_WORDS = 1024


@dataclass
class EngineExtras:
    allowed_token_ids: list[int]
    truncate_prompt_tokens: int | None
    cache_salt: str | None
    bad_words: list[str]
    priority: int


def get_bad_words(body: dict[str, Any]) -> list[str]:
    words = body.get("bad_words")
    if words is None:
        return []
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words):
        raise invalid("'bad_words' must be a list of strings that are not blank", "bad_words")
    if len(words) > MAX_BAD_WORDS:
        raise invalid(f"'bad_words' holds more than {MAX_BAD_WORDS} words", "bad_words")
    return list(dict.fromkeys(words))


def bad_words_token_ids(words: list[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token sequences that write each word: as the text's start, and after a space."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                sequences[ids] = None
    return [list(ids) for ids in sequences]


def parse_engine_extras(body: dict[str, Any]) -> EngineExtras:
    allowed = get_int_list(body, "allowed_token_ids")
    if body.get("allowed_token_ids") is not None and not allowed:
        raise invalid("'allowed_token_ids' must not be empty", "allowed_token_ids")
    truncate = get_int(body, "truncate_prompt_tokens", None, lo=-1, hi=MAX_INT32)
    if truncate == 0:
        raise invalid(
            "'truncate_prompt_tokens' must be at least 1, or -1 for the context's length",
            "truncate_prompt_tokens",
        )
    salt = get_str(body, "cache_salt", None)
    if salt is not None and not salt:
        raise invalid("'cache_salt' must not be empty", "cache_salt")
    priority = get_int(body, "priority", 0, lo=-MAX_INT32, hi=MAX_INT32)
    return EngineExtras(sorted(set(allowed)), truncate, salt, get_bad_words(body), priority)


def truncate_prompt(packed: bytes, truncate_prompt_tokens: int | None, max_model_len: int) -> bytes:
    """The packed prompt ids, cut to their last ``truncate_prompt_tokens``."""
    if truncate_prompt_tokens is None:
        return packed
    keep = max_model_len if truncate_prompt_tokens < 0 else truncate_prompt_tokens
    if keep > max_model_len:
        raise invalid(
            f"'truncate_prompt_tokens' ({keep}) exceeds the context length ({max_model_len})",
            "truncate_prompt_tokens",
        )
    return packed[-4 * keep :] if len(packed) > 4 * keep else packed
