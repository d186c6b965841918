"""Request fields this server cannot honour, refused with a 400 that names them.

Unknown fields are ignored (clients send extras such as ``store`` or ``metadata`` that change
nothing here); the first request to carry one names it in the log. The fields below would change what the client gets back if they worked, so
ignoring them would answer another question than the one asked: audio, server-side best-of
and insertion are not implemented.
A field at its "off" value (``best_of`` equal to ``n``, an empty ``suffix``) is accepted.
"""

from __future__ import annotations

import logging
from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import get_int, get_str
from frontend_proc.structured_output import STRUCTURED_FIELDS

logger = logging.getLogger(__name__)


def refuse_unsupported_completion_fields(body: dict[str, Any], n: int) -> None:
    if get_str(body, "suffix", ""):
        raise invalid("'suffix' is not supported", "suffix")
    best_of = get_int(body, "best_of", None, lo=1)
    if best_of is not None and best_of < n:
        raise invalid(f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    if best_of is not None and best_of > n:
        raise invalid(
            "'best_of' greater than 'n' is not supported: ask for 'n' choices instead",
            "best_of",
        )


def refuse_unsupported_chat_fields(body: dict[str, Any]) -> None:
    """Tools and tool_choice are checked by frontend_proc/tool_calls.py."""
    modalities = body.get("modalities")
    if body.get("audio") is not None or (
        modalities is not None and modalities != ["text"] and modalities != []
    ):
        raise invalid("audio output is not supported", "audio" if "audio" in body else "modalities")
    refuse_request_chat_template(body)


def refuse_request_chat_template(body: dict[str, Any]) -> None:
    """A template from the request would run the client's code in every tokenizer process;
    the server's own is set at start-up."""
    if body.get("chat_template") is not None:
        raise invalid(
            "a chat template in the request is not accepted; the server's is set at start-up "
            "(--chat-template)",
            "chat_template",
        )


# Every field a request may carry that something here reads.
_COMMON_FIELDS = (
    frozenset(
        (
            "model max_tokens temperature top_p top_k min_p seed min_tokens ignore_eos "
            "stop_token_ids stop include_stop_str_in_output presence_penalty frequency_penalty "
            "repetition_penalty skip_special_tokens logit_bias n stream stream_options user "
            "allowed_token_ids truncate_prompt_tokens cache_salt bad_words priority "
            "return_tokens_as_token_ids prompt_logprobs add_special_tokens"
        ).split()
    )
    | STRUCTURED_FIELDS
)
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "logprobs", "echo", "return_token_ids"}
COMPLETION_FIELDS |= {"suffix", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
CHAT_FIELDS |= {"chat_template_kwargs", "add_generation_prompt", "tools", "tool_choice"}
CHAT_FIELDS |= {"continue_final_message", "parallel_tool_calls", "include_reasoning", "echo"}
CHAT_FIELDS |= {"functions", "function_call", "audio", "modalities", "chat_template"}
# OpenAI fields that change nothing a server like this one returns.
_NO_EFFECT = frozenset(("store", "metadata", "service_tier"))
_logged: set[str] = set()


def log_ignored_fields(body: dict[str, Any], known: frozenset[str]) -> None:
    """Name, once per process and field, a request field that is ignored: what a client
    expected of it did not happen, and the log should say so."""
    for name in body.keys() - known - _NO_EFFECT - _logged:
        if len(_logged) >= 1000:  # a client inventing names cannot grow this without end
            return
        _logged.add(name)
        logger.warning("ignoring the request field %r, which this server does not use", name)
