"""Tool calling in the Hermes format of Qwen2.5 and Qwen3: the chat template lists the
request's ``tools`` for the model, which calls one by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

in its answer (after any ``<think>`` block). This module checks a request's ``tools`` and
``tool_choice``, and turns such blocks into OpenAI ``tool_calls``: at once for a whole
output, or delta by delta for a stream, where a call is sent as soon as its name is written
and its arguments follow as the model writes them. A block whose JSON does not parse is
left in the content, as the model wrote it (a streamed call already announced keeps the
arguments it was written with).

``tool_choice`` may be "auto" (the default when tools are given) or "none" (the tools are
then not shown to the model); "required" and a named function constrain the answer to
calls (frontend_proc/forced_tool_calls.py).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.reasoning import partial_tail

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
# A template that writes this tag teaches the model the format parsed here.
TEMPLATE_MARK = CALL_START


# --tool-call-parser's choices: "auto", and the names other servers give this format.
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen25")


def check_tool_call_parser(name: str, template_source: str | None) -> None:
    """A named parser asserts that the model calls tools in this format; raises ValueError
    before anything starts if its chat template does not teach it."""
    if name != "auto" and (template_source is None or TEMPLATE_MARK not in template_source):
        raise ValueError(
            f"--tool-call-parser {name}: this model's chat template writes no {CALL_START} "
            "blocks, so its tool calls could not be parsed (give a template that does with "
            "--chat-template, or leave the option out)"
        )


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a chat request shows the model, or None (no tools, or ``tool_choice``
    "none")."""
    tools = body.get("tools")
    tool_choice = body.get("tool_choice")
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise invalid(f"'{name}' is deprecated and not supported: use 'tools'", name)
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
        "id": _new_call_id(),
        "type": "function",
        "function": {"name": value["name"], "arguments": arguments},
    }


# The start of a block whose arguments can be streamed: the name, then an object.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class _OpenCall:
    """A block being written. Once its name is known (the Hermes order: name, then an
    arguments object) the call is announced and its arguments stream as the model writes
    them: everything before the block's last ``}`` is arguments, since the object holding
    them closes last. Other blocks are parsed whole when they close."""

    __slots__ = ("index", "text", "call_id", "name", "args_start", "sent")

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.call_id = ""
        self.name = ""
        self.args_start = -1  # -1: not announced
        self.sent = 0  # characters of the arguments sent

    def _arguments(self, closed: bool) -> str:
        region = self.text[self.args_start :]
        last = region.rfind("}")
        if last < 0:
            return region.rstrip() if closed else ""
        return region[:last].rstrip() if closed else region[:last]

    def progress(self, more: str) -> list[dict[str, Any]]:
        self.text += more
        deltas: list[dict[str, Any]] = []
        if self.args_start < 0:
            match = _HEADER.match(self.text)
            if match is None:
                return deltas
            self.name = json.loads(f'"{match.group(1)}"')
            self.call_id = _new_call_id()
            self.args_start = match.end()
            function = {"name": self.name, "arguments": ""}
            deltas.append(
                {"index": self.index, "id": self.call_id, "type": "function", "function": function}
            )
        deltas += self._send(self._arguments(closed=False))
        return deltas

    def _send(self, arguments: str) -> list[dict[str, Any]]:
        if len(arguments) <= self.sent:
            return []
        piece, self.sent = arguments[self.sent :], len(arguments)
        return [{"index": self.index, "function": {"arguments": piece}}]

    def close(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """(the call, or None if the block is not one; the last deltas)."""
        if self.args_start < 0:
            call = _call(self.text.strip())
            return call, [] if call is None else [{"index": self.index, **call}]
        arguments = self._arguments(closed=True)
        function = {"name": self.name, "arguments": arguments}
        call = {"id": self.call_id, "type": "function", "function": function}
        return call, self._send(arguments)


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """The content of one choice, streamed: text passes through, and each tool-call block
    comes out as ``delta.tool_calls`` entries (the call with its name, then its arguments
    piece by piece; or whole when the block closes, if its shape is not the usual one)."""

    __slots__ = ("_held", "_open", "calls", "_max_calls", "_dropping")

    def __init__(self, max_calls: int | None = None) -> None:
        self._held = ""
        self._open: _OpenCall | None = None
        self.calls: list[dict[str, Any]] = []  # every complete call so far
        # parallel_tool_calls false: the blocks after the first call are dropped whole.
        self._max_calls = max_calls
        self._dropping = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """Add content; return the content ready to send and the tool-call deltas."""
        buffer = self._held + text
        self._held = ""
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while buffer:
            if self._open is not None:
                end = buffer.find(CALL_END)
                if end < 0:
                    keep = partial_tail(buffer, CALL_END)
                    deltas += self._open.progress(buffer[: len(buffer) - keep])
                    self._held = buffer[len(buffer) - keep :]
                    break
                deltas += self._open.progress(buffer[:end])
                buffer = buffer[end + len(CALL_END) :]
                call, last = self._open.close()
                deltas += last
                if call is None and not self._dropping:
                    content.append(CALL_START + self._open.text + CALL_END)
                elif call is not None and not self._dropping:
                    self.calls.append(call)
                self._open, self._dropping = None, False
                continue
            start = buffer.find(CALL_START)
            if start < 0:
                keep = partial_tail(buffer, CALL_START)
                content.append(buffer[: len(buffer) - keep])
                self._held = buffer[len(buffer) - keep :]
                break
            content.append(buffer[:start])
            buffer = buffer[start + len(CALL_START) :]
            self._open = _OpenCall(len(self.calls))
            self._dropping = self._max_calls is not None and len(self.calls) >= self._max_calls
        text_out = "".join(content)
        if (self.calls or self._open is not None) and not text_out.strip():
            text_out = ""  # the newlines around and between calls
        if self._max_calls is not None:
            deltas = [delta for delta in deltas if delta["index"] < self._max_calls]
        return text_out, deltas

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """What is held back as the output ends. An unclosed block stays text, unless its
        call was announced: then the arguments written so far complete it."""
        held, self._held = self._held, ""
        open_call, self._open = self._open, None
        if open_call is None:
            return held, []
        if self._dropping:
            self._dropping = False
            return "", []
        deltas = open_call.progress(held)
        if open_call.args_start < 0:
            return CALL_START + open_call.text, []
        call, last = open_call.close()
        assert call is not None
        self.calls.append(call)
        return "", deltas + last


def split_tool_calls(text: str, max_calls: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A whole content as (content without the calls, the calls); a call's arguments are
    its parsed JSON written out again. Past ``max_calls`` calls, call blocks are dropped."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    rest = text
    while (start := rest.find(CALL_START)) >= 0:
        end = rest.find(CALL_END, start)
        if end < 0:
            break
        block = rest[start + len(CALL_START) : end]
        call = _call(block.strip())
        content.append(rest[:start] if call is not None else rest[: end + len(CALL_END)])
        if call is not None and (max_calls is None or len(calls) < max_calls):
            calls.append(call)
        rest = rest[end + len(CALL_END) :]
    content.append(rest)
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def finish_reason(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
    """An output that stopped after calling tools ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if calls and reason == "stop" else reason
