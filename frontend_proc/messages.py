"""The ``messages`` field of a chat request, normalized to what chat templates expect.

Content parts are joined into one string, because the chat templates of text models read
``message.content`` as a string. Keys whose value is null are dropped, because templates test
``is defined`` and would otherwise render "None" (transformers does the same).
"""

from __future__ import annotations

from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import type_name

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role; templates only know "system".
ROLE_ALIASES = {"developer": "system"}
# Optional message fields that templates read, passed through when they are well-formed.
_STRING_FIELDS = ("name", "tool_call_id", "reasoning_content")


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(
            f"{where}.content must be a string or a list of content parts, got {type_name(value)}",
            "messages",
        )
    texts = []
    for part in value:
        if not isinstance(part, dict):
            raise invalid(f"{where}.content holds a part that is not an object", "messages")
        kind = part.get("type")
        if kind != "text":
            raise invalid(
                f"{where}.content holds a part of type {kind!r}; only 'text' parts are supported",
                "messages",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid(f"{where}.content holds a text part without a string 'text'", "messages")
        texts.append(text)
    return "\n".join(texts)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(call, dict) for call in value):
        raise invalid(f"{where}.tool_calls must be a list of objects", "messages")
    calls = []
    for call in value:
        function = call.get("function")
        if function is not None and not isinstance(function, dict):
            raise invalid(f"{where}.tool_calls[].function must be an object", "messages")
        calls.append({key: item for key, item in call.items() if item is not None})
    return calls


def parse_message(raw: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise invalid(f"{where} must be an object, got {type_name(raw)}", "messages")
    role = raw.get("role")
    if not isinstance(role, str):
        raise invalid(f"{where}.role must be a string", "messages")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLES:
        raise invalid(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
    message: dict[str, Any] = {"role": role}
    content = raw.get("content")
    tool_calls = raw.get("tool_calls")
    if content is not None:
        message["content"] = _content(content, where)
    elif role != "assistant" or tool_calls is None:
        # Only an assistant turn that calls tools may go without content.
        raise invalid(f"{where}.content is required", "messages")
    else:
        # As an empty string: templates read it (Qwen3's tests "'</think>' in content").
        message["content"] = ""
    if tool_calls is not None:
        if role != "assistant":
            raise invalid(f"{where}.tool_calls is only allowed on assistant messages", "messages")
        message["tool_calls"] = _tool_calls(tool_calls, where)
    for name in _STRING_FIELDS:
        value = raw.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise invalid(f"{where}.{name} must be a string", "messages")
        message[name] = value
    return message


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid(f"'messages' must be a list, got {type_name(value)}", "messages")
    if not value:
        raise invalid("'messages' must not be empty", "messages")
    return [parse_message(raw, index) for index, raw in enumerate(value)]
