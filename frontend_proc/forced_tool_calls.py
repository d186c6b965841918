"""Forced tool calls: ``tool_choice`` "required" or a named function.

The answer is constrained (structured output) to the calls themselves, so it is one:

- a named function: the output is that function's arguments, a JSON object of its
  ``parameters`` schema; it comes back as the one call, with ``finish_reason`` "stop";
- "required": the output is a JSON array of at least one ``{"name": ..., "parameters":
  {...}}`` (exactly one with ``parallel_tool_calls`` false), each naming one of the tools
  and carrying arguments of its schema; each element is a call, and ``finish_reason`` is
  "tool_calls".

A stream announces the named call at once and streams its arguments as they are written;
with "required", each call is sent whole as soon as its element of the array closes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from frontend_proc.errors import invalid
from pegainfer.protocol import StructuredOutput

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ForcedCalls:
    name: str | None  # the named function; None for "required"
    constraint: StructuredOutput

    def parser(self) -> NamedCallParser | RequiredCallsParser:
        return NamedCallParser(self.name) if self.name is not None else RequiredCallsParser()

    def split(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output as (content, calls): the content is None once there are calls."""
        parser = self.parser()
        content, _ = parser.feed(text)
        more, _ = parser.flush()
        content += more
        return (None if parser.calls else content), parser.calls

    def finish_reason(self, reason: str | None, calls: list[dict[str, Any]]) -> str | None:
        if self.name is None and calls and reason == "stop":
            return "tool_calls"
        return reason


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or _ANY_OBJECT


def forced_calls(
    tools: list[dict[str, Any]] | None, tool_choice: Any, max_calls: int | None = None
) -> ForcedCalls | None:
    """The constraint that ``tool_choice`` puts on the answer, or None ("auto", "none");
    "required" writes at most ``max_calls`` calls when given."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if not tools:
        raise invalid("'tool_choice' other than 'auto' or 'none' needs 'tools'", "tool_choice")
    if tool_choice == "required":
        elements = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
            }
            for tool in tools
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": elements}}
        if max_calls is not None:
            schema["maxItems"] = max_calls
        return ForcedCalls(None, StructuredOutput("json", json.dumps(schema)))
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not name:
        raise invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    for tool in tools:
        if tool["function"]["name"] == name:
            return ForcedCalls(name, StructuredOutput("json", json.dumps(_parameters(tool))))
    raise invalid(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class NamedCallParser:
    """The output is the arguments of one call. Whitespace around them is dropped."""

    __slots__ = ("name", "calls", "_held", "_started")

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[dict[str, Any]] = []
        self._held = ""  # whitespace that may turn out to be the end
        self._started = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        text = self._held + text
        if not self._started:
            text = text.lstrip()
            if not text:
                self._held = ""
                return "", deltas
            self._started = True
            call = {"id": _call_id(), "type": "function", "function": {"name": self.name}}
            self.calls.append({**call, "function": {"name": self.name, "arguments": ""}})
            deltas.append({"index": 0, **call, "function": {"name": self.name, "arguments": ""}})
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            self.calls[0]["function"]["arguments"] += body
            deltas.append({"index": 0, "function": {"arguments": body}})
        return "", deltas

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        self._held = ""
        return "", []


class RequiredCallsParser:
    """The output is a JSON array of calls; each element becomes a call once it closes."""

    __slots__ = ("calls", "_text", "_element", "_depth", "_in_string", "_escaped")

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._text: list[str] = []  # all of it: content, if no call ever closes
        self._element: list[str] = []
        self._depth = 0  # 1 inside the array
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        self._text.append(text)
        for char in text:
            if self._depth >= 2:
                self._element.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                continue
            if char == '"':
                self._in_string = True
            elif char in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element = [char]
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1:
                    deltas += self._close_element()
        return "", deltas

    def _close_element(self) -> list[dict[str, Any]]:
        try:
            element = json.loads("".join(self._element))
        except json.JSONDecodeError:
            return []
        if not isinstance(element, dict) or not isinstance(element.get("name"), str):
            return []
        arguments = json.dumps(element.get("parameters", {}), ensure_ascii=False)
        call = {
            "id": _call_id(),
            "type": "function",
            "function": {"name": element["name"], "arguments": arguments},
        }
        self.calls.append(call)
        return [{"index": len(self.calls) - 1, **call}]

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """An output cut short before any call closed is returned as content."""
        return ("" if self.calls else "".join(self._text)), []
