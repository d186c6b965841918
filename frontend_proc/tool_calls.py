"""Tool calling in the Hermes format of Qwen2.5 and Qwen3: the chat template lists the
request's ``tools`` for the model, which calls one by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in its answer (after any ``<think>`` block). This module checks a request's ``tools`` and
``tool_choice``, and turns such blocks into OpenAI ``tool_calls``: at once for a whole
output, or delta by delta for a stream, where the text of a block is held back until it
closes and then sent as one tool-call delta. A block whose JSON does not parse is left in
the content, as the model wrote it.

``tool_choice`` may be "auto" (the default when tools are given) or "none" (the tools are
then not shown to the model). "required" and a named function would need the output
constrained to a call, which this server does not do: they are refused.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.reasoning import partial_tail

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
# A template that writes this tag teaches the model the format parsed here.
TEMPLATE_MARK = CALL_START


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a chat request shows the model, or None (no tools, or ``tool_choice``
    "none")."""
    tools = body.get("tools")
    tool_choice = body.get("tool_choice")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise invalid(f"'{name}' is deprecated and not supported: use 'tools'", name)
    if tool_choice is not None and tool_choice not in ("none", "auto"):
        raise invalid(
            '\'tool_choice\' may be "auto" or "none": forcing a call ("required" or a '
            "named function) is not supported",
            "tool_choice",
        )
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise invalid(f"tools[{index}] must be an object of type 'function'", "tools")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(f"tools[{index}].function must be an object with a 'name'", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"tools[{index}].function.parameters must be an object", "tools")
    if not tools or tool_choice == "none":
        return None
    return tools


def _call(block: str) -> dict[str, Any] | None:
    """An OpenAI tool call from the JSON inside one block, or None if it is not one."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": arguments},
    }


class ToolCallParser:
    """The content of one choice, streamed: text passes through, tool-call blocks come out
    as calls once closed."""

    __slots__ = ("_held", "_in_call", "calls")

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.calls: list[dict[str, Any]] = []  # every call so far

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add content; return the content ready to send and the calls just closed."""
        buffer = self._held + text
        self._held = ""
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while buffer:
            if self._in_call:
                end = buffer.find(CALL_END)
                if end < 0:
                    self._held = buffer
                    break
                block, buffer = buffer[:end], buffer[end + len(CALL_END) :]
                self._in_call = False
                call = _call(block.strip())
                if call is None:
                    content.append(CALL_START + block + CALL_END)
                else:
                    calls.append(call)
                continue
            start = buffer.find(CALL_START)
            if start < 0:
                keep = partial_tail(buffer, CALL_START)
                content.append(buffer[: len(buffer) - keep])
                self._held = buffer[len(buffer) - keep :]
                break
            content.append(buffer[:start])
            buffer = buffer[start + len(CALL_START) :]
            self._in_call = True
        self.calls += calls
        text_out = "".join(content)
        if self.calls and not text_out.strip():
            text_out = ""  # the newlines around and between calls
        return text_out, calls

    def flush(self) -> str:
        """What is held back as the output ends: an unclosed block stays text."""
        held, self._held = self._held, ""
        if self._in_call:
            self._in_call = False
            return CALL_START + held
        return held


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole content as (content without the calls, the calls)."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    content += parser.flush()
    return (content.strip() if calls else content), calls


def finish_reason(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    """An output that stopped after calling tools ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if calls and reason == "stop" else reason


def tool_call_deltas(calls: list[dict[str, Any]], first_index: int) -> list[dict[str, Any]]:
    """Streamed ``delta.tool_calls`` entries: each call whole, numbered from ``first_index``."""
    return [{"index": first_index + i, **call} for i, call in enumerate(calls)]
