"""The output of one /v1/responses answer: its items (reasoning, the message, function
calls) built as the text comes, and the stream events that announce each change.

Items open in the order the model writes them; opening one closes the one before. A closed
item is ``completed``, or ``incomplete`` when the answer ran out of ``max_output_tokens``.
"""

from __future__ import annotations

import uuid
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseItems:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []  # not yet sent; a whole answer drops them
        self._open: dict[str, Any] | None = None
        self._open_text: list[str] = []  # the open item's text, or a call's arguments
        self._open_logprobs: list[dict[str, Any]] = []  # the open message's tokens'
        self._pending_logprobs: list[dict[str, Any]] = []  # content tokens whose text is held

    # -- what the model wrote ----------------------------------------------------------------

    def reasoning(self, text: str) -> None:
        if not text:
            return
        if self._kind() != "reasoning":
            item = {
                "type": "reasoning",
                "id": item_id("rs"),
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            self._start(item, None)
        self._open_text.append(text)
        self._event("response.reasoning_text.delta", content_index=0, delta=text)

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> None:
        """More of the message's text, and the logprobs of the tokens that wrote it (tokens
        whose text is still held back wait for it)."""
        if not text:
            self._pending_logprobs.extend(logprobs or [])
            return
        if self._kind() != "message":
            item = {
                "type": "message",
                "id": item_id("msg"),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            self._start(item, {"type": "output_text", "text": "", "annotations": []})
        self._open_text.append(text)
        logprobs, self._pending_logprobs = self._pending_logprobs + list(logprobs or []), []
        self._open_logprobs.extend(logprobs)
        self._event("response.output_text.delta", content_index=0, delta=text, logprobs=logprobs)

    def call(self, call_id: str, name: str, arguments: str = "") -> None:
        item = {
            "type": "function_call",
            "id": item_id("fc"),
            "call_id": call_id,
            "name": name,
            "arguments": "",
            "status": "in_progress",
        }
        self._start(item, None)
        self.arguments(arguments)

    def arguments(self, text: str) -> None:
        if not text or self._kind() != "function_call":
            return
        self._open_text.append(text)
        self._event("response.function_call_arguments.delta", delta=text)

    def chat_fields(
        self, fields: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
    ) -> None:
        """One streamed chat delta's ``reasoning_content``, ``content`` and ``tool_calls``
        (a call's first delta names it; later ones carry more of its arguments), and the
        logprobs of its content tokens."""
        self.reasoning(fields.get("reasoning_content", ""))
        self.content(fields.get("content", ""), logprobs)
        for call in fields.get("tool_calls", []):
            function = call.get("function", {})
            if call.get("id"):
                self.call(call["id"], function.get("name", ""), function.get("arguments", ""))
            else:
                self.arguments(function.get("arguments", ""))

    def message(
        self, message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
    ) -> None:
        """A whole assistant message (``ChatOutput.message``), and its content tokens'
        logprobs."""
        self.reasoning(message.get("reasoning_content") or "")
        self.content(message.get("content") or "", logprobs)
        for call in message.get("tool_calls") or []:
            self.call(call["id"], call["function"]["name"], call["function"]["arguments"])

    def close(self, incomplete: bool = False) -> None:
        """The answer ended: the open item is done."""
        item = self._open
        if item is None:
            return
        text = "".join(self._open_text)
        status = "incomplete" if incomplete and item["type"] != "function_call" else "completed"
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            self._event("response.reasoning_text.done", content_index=0, text=text)
        elif item["type"] == "message":
            logprobs = self._open_logprobs + self._pending_logprobs
            self._pending_logprobs = []
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            item["content"] = [part]
            self._event("response.output_text.done", content_index=0, text=text, logprobs=logprobs)
            self._event("response.content_part.done", content_index=0, part=part)
        else:
            item["arguments"] = text
            self._event("response.function_call_arguments.done", arguments=text)
        item["status"] = status
        self.events.append(
            {
                "type": "response.output_item.done",
                "output_index": len(self.items) - 1,
                "item": item,
            }
        )
        self._open, self._open_text, self._open_logprobs = None, [], []

    # -- the open item ---------------------------------------------------------------------

    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    def _start(self, item: dict[str, Any], part: dict[str, Any] | None) -> None:
        self.close()
        self.items.append(item)
        self._open = item
        index = len(self.items) - 1
        self.events.append(
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)}
        )
        if part is not None:
            self._event("response.content_part.added", content_index=0, part=part)

    def _event(self, kind: str, **fields: Any) -> None:
        assert self._open is not None
        self.events.append(
            {
                "type": kind,
                "item_id": self._open["id"],
                "output_index": len(self.items) - 1,
                **fields,
            }
        )
