"""The body of POST /v1/responses (OpenAI's Responses API), read as the chat request it asks
for: ``input`` items become chat messages, ``instructions`` a system message first, function
tools and ``text.format`` their chat forms. The chat request's own parser then checks every
setting, so both endpoints accept and refuse alike.

Responses are not stored: ``previous_response_id`` and ``conversation``, which would continue
a stored one, are refused, as are background runs, prompt templates, tools other than
functions and inputs other than text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend_proc.errors import invalid
from frontend_proc.fields import get_bool, get_object, get_str, type_name
from frontend_proc.sampling_defaults import SamplingDefaults
from frontend_proc.schemas import (
    DEFAULT_MAX_LOGPROBS,
    NEUTRAL_DEFAULTS,
    ChatCompletionRequest,
    ModelNames,
    parse_chat_request,
    require_object,
)
from frontend_proc.unsupported import log_ignored_fields

# Settings passed to the chat request as they are: OpenAI's, and vLLM's extensions.
_PASSED = (
    "model temperature top_p top_k min_p seed stop stop_token_ids presence_penalty "
    "frequency_penalty repetition_penalty min_tokens ignore_eos logit_bias parallel_tool_calls "
    "priority cache_salt skip_special_tokens include_stop_str_in_output structured_outputs "
    "chat_template_kwargs"
).split()
# Read here, or accepted and changing nothing a server like this one returns.
_READ = (
    _PASSED
    + (
        "input instructions max_output_tokens tools tool_choice text reasoning stream "
        "max_tool_calls metadata user store include service_tier truncation top_logprobs "
        "previous_response_id conversation background prompt safety_identifier "
        "prompt_cache_key"
    ).split()
)
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# What ``include`` names to have the message's tokens' logprobs returned.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


@dataclass
class ResponsesRequest:
    chat: ChatCompletionRequest
    stream: bool
    # The message's tokens' logprobs, with this many alternatives each; None: not asked.
    logprobs: int | None = None
    # What the response object repeats of the request.
    echo: dict[str, Any] = field(default_factory=dict)


def parse_responses_request(
    body: Any,
    served_model_names: ModelNames,
    defaults: SamplingDefaults = NEUTRAL_DEFAULTS,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> ResponsesRequest:
    body = require_object(body)
    _refuse_unsupported(body)
    log_ignored_fields(body, frozenset(_READ))
    chat: dict[str, Any] = {key: body[key] for key in _PASSED if key in body}
    messages = input_messages(body.get("input"))
    instructions = get_str(body, "instructions", None)
    if instructions:
        messages.insert(0, {"role": "system", "content": instructions})
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _chat_tools(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    text = get_object(body, "text")
    if text is not None and get_object(text, "format") is not None:
        response_format = _chat_response_format(text["format"])
        if response_format is not None:
            chat["response_format"] = response_format
    include = body.get("include") or []
    if not isinstance(include, list):
        raise invalid("'include' must be a list", "include")
    top_logprobs = body.get("top_logprobs")
    wants_logprobs = LOGPROBS_INCLUDE in include or bool(top_logprobs)
    if wants_logprobs:
        chat["logprobs"] = True
        if top_logprobs is not None:
            chat["top_logprobs"] = top_logprobs
    reasoning = get_object(body, "reasoning")
    if reasoning is not None and reasoning.get("effort") == "none":
        # Qwen3's switch; templates without it ignore the variable.
        kwargs = dict(get_object(chat, "chat_template_kwargs") or {})
        chat["chat_template_kwargs"] = {"enable_thinking": False, **kwargs}
    request = parse_chat_request(chat, served_model_names, defaults, max_logprobs)
    max_tool_calls = body.get("max_tool_calls")
    if max_tool_calls is not None:
        if not isinstance(max_tool_calls, int) or isinstance(max_tool_calls, bool):
            raise invalid("'max_tool_calls' must be an integer", "max_tool_calls")
        if max_tool_calls < 1:
            raise invalid("'max_tool_calls' must be at least 1", "max_tool_calls")
        request.max_tool_calls = min(max_tool_calls, request.max_tool_calls or max_tool_calls)
    echo = {
        "instructions": instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") or {},
        "parallel_tool_calls": get_bool(body, "parallel_tool_calls", True),
        "temperature": request.sampling.temperature,
        "top_p": request.sampling.top_p,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": tools or [],
        "text": text or {"format": {"type": "text"}},
        "reasoning": reasoning,
        "max_tool_calls": max_tool_calls,
        "user": body.get("user"),
        "store": False,
        "truncation": "disabled",
        "top_logprobs": request.top_logprobs or 0,
    }
    return ResponsesRequest(
        chat=request,
        stream=get_bool(body, "stream", False),
        logprobs=(request.top_logprobs or 0) if wants_logprobs else None,
        echo=echo,
    )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in ("previous_response_id", "conversation"):
        if body.get(name) is not None:
            raise invalid(
                f"'{name}' is not supported: responses are not stored here; send the whole "
                "conversation in 'input'",
                name,
            )
    if get_bool(body, "background", False):
        raise invalid("background responses are not supported", "background")
    if body.get("prompt") is not None:
        raise invalid("prompt templates ('prompt') are not supported", "prompt")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid(
            "only 'truncation': 'disabled' is supported: an input longer than the context is a 400",
            "truncation",
        )


def input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` (a string, or a list of items) as chat messages. Function calls join the
    assistant message before them; reasoning items become the next assistant message's
    ``reasoning_content``."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []

    def assistant() -> dict[str, Any]:
        """The assistant message the next call or reasoning belongs to."""
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or reasoning:
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return last

    for index, item in enumerate(value):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object, got {type_name(item)}", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            content = _text(item.get("content"), where)
            if role == "assistant":
                assistant()["content"] += content
            elif role in ("user", "system", "developer"):
                messages.append({"role": role, "content": content})
            else:
                raise invalid(f"{where}.role must be user, system, developer or assistant", "input")
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, where)
            tool_call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": content})
        elif kind == "reasoning":
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning.append(_text(parts, where))
        else:
            raise invalid(
                f"{where} is of type {kind!r}; messages, function calls, their outputs and "
                "reasoning are supported",
                "input",
            )
    if not messages or all(message["role"] == "system" for message in messages):
        raise invalid("'input' holds no message to answer", "input")
    return messages


def _string(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise invalid(f"{where}.{name} must be a string", "input")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS and kind not in ("reasoning_text", "summary_text"):
            raise invalid(
                f"{where}.content holds a part of type {kind!r}; only text is supported", "input"
            )
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise invalid(f"{where}.content holds a part without a string 'text'", "input")
        texts.append(text)
    return "\n".join(texts)


def _chat_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    chat_tools = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type_name(tool)
            raise invalid(
                f"tools[{index}] is of type {kind!r}; only functions are supported", "tools"
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        chat_tools.append({"type": "function", "function": function})
    return chat_tools


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise invalid(
            f"'tool_choice' of type {choice.get('type')!r} is not supported", "tool_choice"
        )
    return choice


def _chat_response_format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {
            key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt
        }
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"'text.format' of type {kind!r} is not supported", "text")
