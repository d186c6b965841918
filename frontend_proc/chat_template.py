"""Load a checkpoint's chat template and render conversations with it, as transformers'
``apply_chat_template(tokenize=False)`` does, in a jinja2 sandbox (templates are untrusted)."""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontend_proc.errors import invalid

logger = logging.getLogger(__name__)

# Variables the server sets; chat_template_kwargs from a request may not replace them.
_RESERVED = ("messages", "add_generation_prompt", "tools", "documents")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, > and &, which would change what the model sees.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_source(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates; the unnamed use is "default"
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                return template if isinstance(template, str) else None
    return None


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _environment().from_string(source)

    @classmethod
    def load(cls, model_path: str, source_override: str = "") -> ChatTemplate | None:
        """The template of a checkpoint directory (or ``source_override`` with the
        directory's special tokens), or None if it has none."""
        config: dict[str, Any] = {}
        config_file = os.path.join(model_path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        special_tokens = {
            name: text
            for name in _SPECIAL_TOKENS
            if (text := _token_text(config.get(name))) is not None
        }
        if source_override:
            return cls(source_override, special_tokens)
        source = _template_source(config.get("chat_template"))
        jinja_file = os.path.join(model_path, "chat_template.jinja")
        if source is None and os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        if source is None:
            logger.info("%s has no chat template; chat requests will be refused", model_path)
            return None
        return cls(source, special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """Render a conversation; any template error is the request's fault (400).
        ``continue_final_message`` cuts the text right after the last message's content, so
        the model goes on writing it (a prefilled answer), as transformers does."""
        variables: dict[str, Any] = {**self.special_tokens, **(chat_template_kwargs or {})}
        variables.update(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=None,
        )
        try:
            text = self._template.render(**variables)
        except jinja2.exceptions.TemplateError as exc:
            raise invalid(f"the chat template could not render this conversation: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            # A template indexing into a message shape it does not expect fails this way.
            raise invalid(
                f"the chat template could not render this conversation: {type(exc).__name__}: {exc}"
            ) from None
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1].get("content", ""))
        return text


def template_from_option(value: str) -> str:
    """``--chat-template``: a file's text, or the value itself when it is a template.
    Raises ValueError naming what is wrong, a Jinja syntax error included."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")
    try:
        _environment().from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"--chat-template does not compile: line {exc.lineno}: {exc}") from None
    return source


def _cut_after_final_message(text: str, final: str) -> str:
    """``text`` up to the end of the final message's content; templates that trim messages
    (Llama 3.1's) have it stripped."""
    for content in (final, final.strip()):
        end = text.rfind(content)
        if end >= 0:
            return text[: end + len(content)]
    raise invalid(
        "'continue_final_message': the chat template does not write the last message as it is",
        "messages",
    )
