"""What a prompt of known length may ask for: the context-window check and ``max_tokens``
resolution, shared by the tokenizer processes and the frontend's direct path for token-id
prompts. No tokenizer here, so the frontend can import it."""

from __future__ import annotations

import copy

from frontend_proc.errors import invalid
from pegainfer.protocol import SamplingParams

FILL_CONTEXT = -1  # max_tokens meaning "whatever the context window has left"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def resolve_max_tokens(
    prompt_len: int, sampling: SamplingParams, max_model_len: int, is_chat: bool
) -> SamplingParams:
    """Check the request fits the context window; returns sampling with max_tokens resolved."""
    where = "messages" if is_chat else "prompt"
    if prompt_len == 0:
        raise invalid(f"the {where} is empty after tokenization", where)
    resolved = copy.copy(sampling)
    resolved.stop_token_ids = list(sampling.stop_token_ids)
    resolved.stop = list(sampling.stop)
    if resolved.max_tokens == FILL_CONTEXT:
        if prompt_len >= max_model_len:
            raise invalid(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {prompt_len} input tokens, which leaves no room for the "
                f"completion. Please reduce the length of the {where}.",
                where,
                CONTEXT_LENGTH_EXCEEDED,
            )
        resolved.max_tokens = max_model_len - prompt_len
    elif prompt_len + resolved.max_tokens > max_model_len:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + resolved.max_tokens} tokens ({prompt_len} in the {where}, "
            f"{resolved.max_tokens} in the completion). Please reduce the length of the "
            f"{where} or completion.",
            where if prompt_len >= max_model_len else "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if resolved.max_tokens_ceiling is not None:
        resolved.max_tokens = min(resolved.max_tokens, resolved.max_tokens_ceiling)
    if resolved.max_tokens < 1:
        raise invalid("'max_tokens' must be at least 1", "max_tokens")
    if resolved.min_tokens > resolved.max_tokens:
        raise invalid(
            f"'min_tokens' ({resolved.min_tokens}) exceeds the {resolved.max_tokens} tokens "
            "the completion may have",
            "min_tokens",
        )
    return resolved
