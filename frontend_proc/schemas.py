"""Parse and validate the bodies of POST /v1/completions and /v1/chat/completions.

The result is a typed request carrying a ready ``SamplingParams``. Every problem is a 400
``APIError`` naming the offending field; unknown fields are ignored, since OpenAI clients
send extras this server has no use for, but known ones it cannot honour are refused
(frontend_proc/unsupported.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend_proc.engine_extras import parse_engine_extras
from frontend_proc.errors import invalid, model_not_found
from frontend_proc.fields import (
    MAX_INT32,
    MAX_SEED,
    MIN_SEED,
    get_bool,
    get_float,
    get_int,
    get_int_list,
    get_logit_bias,
    get_object,
    get_stop,
    get_str,
)
from frontend_proc.forced_tool_calls import ForcedCalls, forced_calls
from frontend_proc.messages import parse_messages
from frontend_proc.prompts import Prompt, parse_prompt
from frontend_proc.sampling_defaults import SamplingDefaults, read_setting
from frontend_proc.structured_output import parse_structured_output
from frontend_proc.tool_calls import parse_tools
from frontend_proc.unsupported import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    log_ignored_fields,
    refuse_unsupported_chat_fields,
    refuse_unsupported_completion_fields,
)
from pegainfer.protocol import SamplingParams

# The name a request must give the model, or the names it may (the first is the default).
ModelNames = str | tuple[str, ...]
# The most top logprobs a token may ask for, unless --max-logprobs says otherwise (OpenAI's).
DEFAULT_MAX_LOGPROBS = 20
# The most choices one request may ask for, as OpenAI allows.
MAX_N = 128
# Chat without max_tokens: "fill the remaining context", resolved by the tokenizer process.
FILL_CONTEXT = -1
DEFAULT_COMPLETION_MAX_TOKENS = 16
NEUTRAL_DEFAULTS = SamplingDefaults()


@dataclass
class CommonOptions:
    model: str
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    user: str | None
    continuous_usage: bool = False  # every chunk carries its choice's counts (vLLM)
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = None
    add_special_tokens: bool | None = None


@dataclass
class CompletionRequest:
    model: str
    prompts: list[Prompt]
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries its choice's counts (vLLM)
    echo: bool = False
    logprobs: int | None = None
    user: str | None = None
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top ones
    add_special_tokens: bool | None = None  # BOS and the like; None: the tokenizer's own


@dataclass
class ChatCompletionRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries its choice's counts (vLLM)
    logprobs: bool = False
    top_logprobs: int | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # shown to the model, its calls parsed
    continue_final_message: bool = False
    # tool_choice "required" or a named function: the answer is constrained to calls.
    forced_calls: ForcedCalls | None = None
    # parallel_tool_calls false: at most one call (the first the model writes).
    max_tool_calls: int | None = None
    truncate_prompt_tokens: int | None = None
    include_reasoning: bool = True  # false: no reasoning_content, the reasoning dropped
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top ones
    add_special_tokens: bool = False  # over what the template writes
    # vLLM's echo: the last message, the assistant's, opens the answer's content.
    echo_prefix: str = ""


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _model(body: dict[str, Any], served_model_names: ModelNames) -> str:
    """The model the request names, which must be one of the served names (the first if
    it names none)."""
    names = (served_model_names,) if isinstance(served_model_names, str) else served_model_names
    model = get_str(body, "model", names[0])
    if model not in names:
        raise model_not_found(model)
    return model


def _sampling(body: dict[str, Any], max_tokens: int, defaults: SamplingDefaults) -> SamplingParams:
    def setting(name: str) -> Any:
        value = read_setting(body, name)
        return getattr(defaults, name) if value is None else value

    bias_ids, bias_values = get_logit_bias(body)
    return SamplingParams(
        max_tokens=max_tokens,
        max_tokens_ceiling=defaults.max_new_tokens,
        temperature=setting("temperature"),
        top_p=setting("top_p"),
        top_k=setting("top_k"),
        min_p=setting("min_p"),
        seed=get_int(body, "seed", None, lo=MIN_SEED, hi=MAX_SEED),
        min_tokens=get_int(body, "min_tokens", 0, lo=0, hi=MAX_INT32),
        ignore_eos=get_bool(body, "ignore_eos", False),
        stop_token_ids=get_int_list(body, "stop_token_ids"),
        stop=get_stop(body),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
        presence_penalty=get_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=get_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=setting("repetition_penalty"),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
        structured=parse_structured_output(body),
    )


def _common(
    body: dict[str, Any],
    served_model_names: ModelNames,
    max_tokens: int,
    defaults: SamplingDefaults,
    max_logprobs: int,
) -> CommonOptions:
    model = _model(body, served_model_names)
    sampling = _sampling(body, max_tokens, defaults)
    extras = parse_engine_extras(body)
    sampling.allowed_token_ids = extras.allowed_token_ids
    sampling.cache_salt = extras.cache_salt
    sampling.bad_words = extras.bad_words
    sampling.priority = extras.priority
    if max_tokens != FILL_CONTEXT and sampling.min_tokens > max_tokens:
        raise invalid(
            f"'min_tokens' ({sampling.min_tokens}) must not exceed 'max_tokens' ({max_tokens})",
            "min_tokens",
        )
    stream = get_bool(body, "stream", False)
    stream_options = get_object(body, "stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        if not stream:
            raise invalid(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        include_usage = get_bool(stream_options, "include_usage", False)
        # As in vLLM, only with include_usage.
        continuous_usage = include_usage and get_bool(
            stream_options, "continuous_usage_stats", False
        )
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    sampling.prompt_logprobs = prompt_logprobs
    return CommonOptions(
        model=model,
        sampling=sampling,
        n=get_int(body, "n", 1, lo=1, hi=MAX_N),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=get_str(body, "user", None),
        truncate_prompt_tokens=extras.truncate_prompt_tokens,
        return_tokens_as_token_ids=get_bool(body, "return_tokens_as_token_ids", False),
        prompt_logprobs=prompt_logprobs,
        add_special_tokens=get_bool(body, "add_special_tokens", None),
    )


def logprobs_limit(max_logprobs: int) -> int:
    """The most top logprobs a token may ask for (--max-logprobs; -1: no limit but the
    vocabulary)."""
    return MAX_INT32 if max_logprobs < 0 else max_logprobs


def _prompt_logprobs(body: dict[str, Any], stream: bool, max_logprobs: int) -> int | None:
    """vLLM's ``prompt_logprobs``: the top count per prompt token, or None (-1: the whole
    vocabulary, where --max-logprobs allows it). A stream has no place for them, so there
    only 0 is accepted, as vLLM accepts it, and it asks nothing."""
    limit = logprobs_limit(max_logprobs)
    if body.get("prompt_logprobs") == -1:
        if max_logprobs >= 0:
            raise invalid(
                f"'prompt_logprobs' -1 (the whole vocabulary) is more than this server "
                f"returns: at most {max_logprobs} (--max-logprobs)",
                "prompt_logprobs",
            )
        body = {**body, "prompt_logprobs": limit}  # the worker stops at the vocabulary
    value = get_int(body, "prompt_logprobs", None, lo=0, hi=limit)
    if value is None or not stream:
        return value
    if value > 0:
        raise invalid("'prompt_logprobs' is not available when 'stream' is true", "prompt_logprobs")
    return None


def parse_completion_request(
    body: Any,
    served_model_names: ModelNames,
    defaults: SamplingDefaults = NEUTRAL_DEFAULTS,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> CompletionRequest:
    body = require_object(body)
    if body.get("prompt") is None:
        raise invalid("'prompt' is required", "prompt")
    prompts = parse_prompt(body["prompt"])
    max_tokens = get_int(body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, lo=1, hi=MAX_INT32)
    common = _common(body, served_model_names, max_tokens, defaults, max_logprobs)
    refuse_unsupported_completion_fields(body, common.n)
    log_ignored_fields(body, COMPLETION_FIELDS)
    logprobs = get_int(body, "logprobs", None, lo=0, hi=logprobs_limit(max_logprobs))
    common.sampling.logprobs = logprobs
    echo = get_bool(body, "echo", False)
    if echo and any(not isinstance(prompt, str) for prompt in prompts):
        # Echoing token ids needs detokenization, which the frontend does not do.
        raise invalid("'echo' is only supported with text prompts", "echo")
    if echo and common.truncate_prompt_tokens is not None:
        raise invalid("'echo' cannot be combined with 'truncate_prompt_tokens'", "echo")
    if echo and logprobs is not None:
        common.sampling.prompt_logprobs = max(logprobs, common.prompt_logprobs or 0)
    return CompletionRequest(
        model=common.model,
        prompts=prompts,
        sampling=common.sampling,
        n=common.n,
        stream=common.stream,
        include_usage=common.include_usage,
        continuous_usage=common.continuous_usage,
        echo=echo,
        logprobs=logprobs,
        user=common.user,
        return_token_ids=get_bool(body, "return_token_ids", False),
        truncate_prompt_tokens=common.truncate_prompt_tokens,
        return_tokens_as_token_ids=common.return_tokens_as_token_ids,
        prompt_logprobs=common.prompt_logprobs,
        add_special_tokens=common.add_special_tokens,
    )


def render_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message): the prompt ends with the start of
    a new assistant turn, or inside the last message, which the model then goes on."""
    add_generation_prompt = get_bool(body, "add_generation_prompt", True)
    continue_final_message = get_bool(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise invalid(
            "'continue_final_message' needs 'add_generation_prompt': false",
            "continue_final_message",
        )
    return add_generation_prompt, continue_final_message


def _chat_echo(body: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    """vLLM's ``echo`` for chat: the conversation's last message, when it is the assistant's
    (an answer the model goes on), is repeated at the start of the answer."""
    if not get_bool(body, "echo", False) or messages[-1].get("role") != "assistant":
        return ""
    content = messages[-1].get("content")
    return content if isinstance(content, str) else ""


def parse_chat_request(
    body: Any,
    served_model_names: ModelNames,
    defaults: SamplingDefaults = NEUTRAL_DEFAULTS,
    max_logprobs: int = DEFAULT_MAX_LOGPROBS,
) -> ChatCompletionRequest:
    body = require_object(body)
    if body.get("messages") is None:
        raise invalid("'messages' is required", "messages")
    messages = parse_messages(body["messages"])
    refuse_unsupported_chat_fields(body)
    log_ignored_fields(body, CHAT_FIELDS)
    tools = parse_tools(body)
    max_tool_calls = None if get_bool(body, "parallel_tool_calls", True) else 1
    forced = forced_calls(tools, body.get("tool_choice"), max_tool_calls)
    max_tokens = get_int(body, "max_tokens", FILL_CONTEXT, lo=1, hi=MAX_INT32)
    # The newer name wins: OpenAI deprecated max_tokens for chat in its favour.
    max_tokens = get_int(body, "max_completion_tokens", max_tokens, lo=1, hi=MAX_INT32)
    common = _common(body, served_model_names, max_tokens, defaults, max_logprobs)
    if forced is not None:
        if common.sampling.structured is not None:
            raise invalid(
                "a forced tool call cannot be combined with structured output", "tool_choice"
            )
        common.sampling.structured = forced.constraint
    logprobs = get_bool(body, "logprobs", False)
    limit = logprobs_limit(max_logprobs)
    top_logprobs = get_int(body, "top_logprobs", None, lo=0, hi=limit)
    if top_logprobs is not None and not logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    if logprobs:
        common.sampling.logprobs = top_logprobs or 0
    kwargs = get_object(body, "chat_template_kwargs")
    add_generation_prompt, continue_final_message = render_options(body)
    return ChatCompletionRequest(
        model=common.model,
        messages=messages,
        sampling=common.sampling,
        n=common.n,
        stream=common.stream,
        include_usage=common.include_usage,
        continuous_usage=common.continuous_usage,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        user=common.user,
        chat_template_kwargs=dict(kwargs or {}),
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        forced_calls=forced,
        max_tool_calls=max_tool_calls,
        continue_final_message=continue_final_message,
        truncate_prompt_tokens=common.truncate_prompt_tokens,
        include_reasoning=get_bool(body, "include_reasoning", True),
        return_tokens_as_token_ids=common.return_tokens_as_token_ids,
        prompt_logprobs=common.prompt_logprobs,
        add_special_tokens=bool(common.add_special_tokens),
        echo_prefix=_chat_echo(body, messages),
    )
