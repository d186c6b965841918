"""Split a reasoning model's output into ``reasoning_content`` and ``content``.

Qwen3-style models write their reasoning first, between ``<think>`` and ``</think>``, then the
answer. Output that does not start with ``<think>`` (Qwen3 with ``enable_thinking: false``,
whose template closes the think block in the prompt) is all content, unless its prompt
opened the block (Qwen3's thinking-only models): it then starts as reasoning. The parser works on
streamed text: it keeps back a tail that could still be the start of a tag, so a tag split
across deltas is recognised and never leaks into either field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Container, Sequence

THINK_START = "<think>"
THINK_END = "</think>"

_BEFORE, _REASONING, _CONTENT = 0, 1, 2


def check_reasoning_parser(model_path: str, name: str) -> None:
    """A named reasoning parser needs the think tags as tokens of their own; raises
    ValueError before anything starts if the model's tokenizer lacks them."""
    if name in ("auto", "none"):
        return
    with open(os.path.join(model_path, "tokenizer.json"), encoding="utf-8") as f:
        added = {token.get("content") for token in json.load(f).get("added_tokens", [])}
    missing = [tag for tag in (THINK_START, THINK_END) if tag not in added]
    if missing:
        raise ValueError(
            f"--reasoning-parser {name}: this model's tokenizer has no {' or '.join(missing)} "
            "token, so it does not reason in think blocks ('auto' or 'none' serve it)"
        )


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningParser:
    """The state of one choice's output."""

    __slots__ = ("_state", "_held", "_thought")

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = _BEFORE
        self._held = ""
        self._thought = False
        if starts_in_reasoning:
            self.start_in_reasoning()

    def start_in_reasoning(self) -> None:
        """The prompt opened the think block: what comes is reasoning until ``</think>``.
        Before any text only."""
        self._state = _REASONING
        self._thought = True

    def feed(self, text: str) -> tuple[str, str]:
        """Add streamed text; return ``(reasoning, content)`` ready to send."""
        buffer = self._held + text
        self._held = ""
        reasoning = content = ""
        if self._state == _BEFORE:
            stripped = buffer.lstrip()
            if stripped.startswith(THINK_START):
                self._state = _REASONING
                self._thought = True
                buffer = stripped[len(THINK_START) :]
            elif THINK_START.startswith(stripped):  # still undecided ("", "<", "<thi")
                self._held = buffer
                return "", ""
            else:
                self._state = _CONTENT
        if self._state == _REASONING:
            end = buffer.find(THINK_END)
            if end < 0:
                keep = partial_tail(buffer, THINK_END)
                self._held = buffer[len(buffer) - keep :] if keep else ""
                return buffer[: len(buffer) - keep], ""
            reasoning = buffer[:end]
            buffer = buffer[end + len(THINK_END) :]
            self._state = _CONTENT
        content = buffer
        return reasoning, content

    @property
    def in_content(self) -> bool:
        """Past the reasoning (or decided that there is none)."""
        return self._state == _CONTENT

    @property
    def saw_think(self) -> bool:
        """Whether the output opened a think block."""
        return self._state == _REASONING or self._thought

    def flush(self) -> tuple[str, str]:
        """What is still held back, as the output ends."""
        held, self._held = self._held, ""
        if self._state == _REASONING:
            return held, ""
        return "", held


class ReasoningTokenCounter:
    """The output tokens a choice spent reasoning, its think tags included, counted delta by
    delta (a delta holds the text of one token, or of a few)."""

    def __init__(self) -> None:
        self._parser = ReasoningParser()
        self._undecided = 0  # tokens before the output showed whether it thinks
        self.count = 0

    def add(self, text: str, num_tokens: int, starts_in_reasoning: bool = False) -> None:
        parser = self._parser
        if parser.in_content:
            return
        if starts_in_reasoning:
            parser.start_in_reasoning()
        parser.feed(text)
        if parser.saw_think:
            self.count += self._undecided + num_tokens
            self._undecided = 0
        elif not parser.in_content:
            self._undecided += num_tokens


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """A whole output as ``(reasoning_content, content)``; reasoning is None when the output
    has no think block."""
    parser = ReasoningParser(starts_in_reasoning)
    reasoning, content = parser.feed(text)
    more_reasoning, more_content = parser.flush()
    if not parser.saw_think:
        return None, content + more_content
    return reasoning + more_reasoning, content + more_content


def turn_reasoning(
    prompt_ids: Sequence[int], think_start_id: int, think_end_id: int, turn_marks: Container[int]
) -> str:
    """Where the chat turn being written stands with its reasoning, going back from the
    prompt's end to the turn's first special token (in ``turn_marks``): ``"open"`` (the
    prompt opened a think block, as Qwen3's thinking-only models' templates do),
    ``"closed"`` (the prompt closed it: Qwen3 with ``enable_thinking: false``) or ``"none"``
    (the model opens its own, or does not think)."""
    for token_id in reversed(prompt_ids):
        if token_id == think_end_id:
            return "closed"
        if token_id == think_start_id:
            return "open"
        if token_id in turn_marks:
            return "none"
    return "none"
