"""How a chat request's generated text becomes an assistant's answer: the reasoning split off
(for models that reason in ``<think>`` blocks), tool calls parsed or forced, and the finish
reason that follows. Shared by /v1/chat/completions and /v1/responses, whole or streamed."""

from __future__ import annotations

from typing import Any

from frontend_proc.logprobs import TokenEntry
from frontend_proc.reasoning import ReasoningParser, split_reasoning
from frontend_proc.schemas import ChatCompletionRequest
from frontend_proc.serving_common import ChoiceState
from frontend_proc.tool_calls import (
    CALL_END,
    CALL_START,
    ToolCallParser,
    finish_reason,
    split_tool_calls,
)
from pegainfer.protocol import TextDelta


class ChatOutput:
    """One request's settings for reading its outputs."""

    def __init__(self, request: ChatCompletionRequest, reasoning: bool) -> None:
        self.request = request
        self.reasoning = reasoning  # the model reasons in <think> blocks

    def message(self, state: ChoiceState) -> dict[str, Any]:
        """A whole choice as an assistant message; sets the state's finish reason to
        "tool_calls" where the answer called tools."""
        request, forced = self.request, self.request.forced_calls
        reasoning, content = (
            split_reasoning(state.text, state.starts_in_reasoning)
            if self.reasoning
            else (None, state.text)
        )
        fields: dict[str, Any] = {"role": "assistant", "content": content}
        fields["reasoning_content"] = reasoning if request.include_reasoning else None
        if forced is not None:
            fields["content"], calls = forced.split(content or "")
            fields["tool_calls"] = calls
            state.finish_reason = forced.finish_reason(state.finish_reason, calls)
        elif request.tools is not None:
            content, calls = split_tool_calls(content, request.max_tool_calls)
            fields["content"] = content if content or not calls else None
            fields["tool_calls"] = calls
            state.finish_reason = finish_reason(state.finish_reason, calls)
        if request.echo_prefix:
            fields["content"] = request.echo_prefix + (fields["content"] or "")
        return fields

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def content_tokens(self) -> ContentTokens:
        return ContentTokens(self)


class ChoiceStream:
    """One streamed choice: each delta's text as the fields of a chat chunk's delta."""

    def __init__(self, output: ChatOutput) -> None:
        request = output.request
        self.request = request
        self.reasoning_parser = ReasoningParser() if output.reasoning else None
        self.echo_pending = request.echo_prefix
        self.tool_parser: Any = None
        if request.forced_calls is not None:
            self.tool_parser = request.forced_calls.parser()
        elif request.tools is not None:
            self.tool_parser = ToolCallParser(request.max_tool_calls)

    def fields(self, delta: TextDelta) -> dict[str, Any]:
        """``reasoning_content``, ``content`` and ``tool_calls`` (each only when non-empty)."""
        reasoning, content = "", delta.text
        parser = self.reasoning_parser
        if parser is not None:
            if delta.starts_in_reasoning:
                parser.start_in_reasoning()
            reasoning, content = parser.feed(delta.text)
            if delta.finish_reason is not None:
                more_reasoning, more_content = parser.flush()
                reasoning += more_reasoning
                content += more_content
        fields: dict[str, Any] = {}
        if reasoning and self.request.include_reasoning:
            fields["reasoning_content"] = reasoning
        if self.tool_parser is not None:
            content, calls = self.tool_parser.feed(content)
            if delta.finish_reason is not None:
                more_content, more_calls = self.tool_parser.flush()
                content += more_content
                calls += more_calls
            if calls:
                fields["tool_calls"] = calls
        if self.echo_pending:
            content, self.echo_pending = self.echo_pending + content, ""
        if content:
            fields["content"] = content
        return fields

    def finish_reason(self, state: ChoiceState) -> str | None:
        """The finished choice's reason, "tool_calls" where it called tools."""
        reason = state.finish_reason
        forced = self.request.forced_calls
        if forced is not None:
            return forced.finish_reason(reason, self.tool_parser.calls)
        if self.tool_parser is not None:
            return finish_reason(reason, self.tool_parser.calls)
        return reason


class ContentTokens:
    """Which output tokens write the answer's content, not its reasoning or its tool calls:
    decided in order, from each token's text (a think tag or a tool-call tag of its own, as
    Qwen3's tokenizer has them). Tokens before the output shows whether it thinks wait."""

    def __init__(self, output: ChatOutput) -> None:
        self.reasoning_parser = ReasoningParser() if output.reasoning else None
        self.forced = output.request.forced_calls is not None  # the answer is all calls
        self.tools = output.request.tools is not None
        self.in_call = False
        self.undecided: list[TokenEntry] = []

    def start_in_reasoning(self) -> None:
        if self.reasoning_parser is not None:
            self.reasoning_parser.start_in_reasoning()

    def take(self, entries: list[TokenEntry]) -> list[TokenEntry]:
        """The content tokens among these, and among those that waited, now decided."""
        return [chosen for entry in entries for chosen in self._decide(entry)]

    def flush(self) -> list[TokenEntry]:
        """The output ended before deciding: what waited was content, as its text is."""
        waited, self.undecided = self.undecided, []
        return [entry for entry in waited if self._outside_calls(entry.text)]

    def _decide(self, entry: TokenEntry) -> list[TokenEntry]:
        if self.forced:
            return []
        parser = self.reasoning_parser
        if parser is not None and not parser.in_content:
            parser.feed(entry.text)
            if not parser.in_content and not parser.saw_think:
                self.undecided.append(entry)
                return []
            waited, self.undecided = self.undecided, []
            if parser.saw_think:
                return []  # reasoning, or the tag that closes it
            return [e for e in [*waited, entry] if self._outside_calls(e.text)]
        return [entry] if self._outside_calls(entry.text) else []

    def _outside_calls(self, text: str) -> bool:
        if not self.tools:
            return True
        if CALL_START in text:
            self.in_call = True
        inside = self.in_call
        if CALL_END in text:
            self.in_call = False
        return not inside
