"""Request fields this server cannot honour, refused with a 400 that names them.

Unknown fields are ignored (clients send extras such as ``store`` or ``metadata`` that change
nothing here). The fields below would change what the client gets back if they worked, so
ignoring them would answer another question than the one asked: structured output, audio,
server-side best-of and insertion are not implemented (forced tool calls neither:
frontend_proc/tool_calls.py). A field at its "off" value (``response_format: {"type":
"text"}``, ``best_of`` equal to ``n``, an empty ``suffix``) is accepted.
"""

from __future__ import annotations

from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import get_int, get_str


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
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind != "text":
            raise invalid(
                "structured output is not supported: 'response_format' may only be "
                '{"type": "text"}',
                "response_format",
            )
    modalities = body.get("modalities")
    if body.get("audio") is not None or (
        modalities is not None and modalities != ["text"] and modalities != []
    ):
        raise invalid("audio output is not supported", "audio" if "audio" in body else "modalities")
