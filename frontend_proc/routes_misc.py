"""The endpoints around generation: /health, /version, /metrics, /v1/models/{id}, and vLLM's
/tokenize and /detokenize (served from a tokenizer the frontend loads itself)."""

from __future__ import annotations

import asyncio
import importlib.metadata
from typing import Any

from aiohttp import web

from frontend_proc import metrics
from frontend_proc.errors import SERVER_ERROR, APIError, error_body, invalid, model_not_found
from frontend_proc.fields import get_bool, get_object, get_str
from frontend_proc.messages import parse_messages
from frontend_proc.preprocess import Preprocessor, check_token_ids
from frontend_proc.server_state import ServerState, dead_reason
from frontend_proc.serving_common import ServingContext, json_response

# Inputs larger than this are tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 32_768


def model_card(ctx: ServingContext) -> dict[str, Any]:
    return {
        "id": ctx.served_model_name,
        "object": "model",
        "created": ctx.created,
        "owned_by": "pegainfer",
        "root": ctx.model_path,
        "parent": None,
        "max_model_len": ctx.max_model_len,
    }


def health_response(state: ServerState, engine: Any) -> web.Response:
    reason = dead_reason(engine)
    if reason is not None:
        message = f"the engine is not available: {reason}"
        return json_response(error_body(message, SERVER_ERROR, None, "engine_dead"), 503)
    if state.draining:
        message = "the server is shutting down"
        return json_response(error_body(message, SERVER_ERROR, None, "server_draining"), 503)
    return web.Response(status=200)


def _version() -> str:
    try:
        return importlib.metadata.version("pegainfer")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+unknown"


def version_response() -> web.Response:
    return json_response({"version": _version()})


def metrics_response(ctx: ServingContext, state: ServerState, engine: Any) -> web.Response:
    request_metrics = getattr(engine, "metrics", None) or metrics.RequestMetrics()
    text = metrics.render(
        ctx.served_model_name,
        getattr(engine, "stats", None),
        request_metrics,
        num_in_flight=getattr(engine, "num_active", 0),
        healthy=dead_reason(engine) is None and not state.draining,
    )
    response = web.Response(body=text.encode(), status=200)
    response.headers["Content-Type"] = metrics.CONTENT_TYPE
    return response


def get_model(ctx: ServingContext, model: str) -> web.Response:
    if model != ctx.served_model_name:
        raise model_not_found(model)
    return json_response(model_card(ctx))


def _require_tokenizer(preprocessor: Preprocessor | None) -> Preprocessor:
    if preprocessor is None:
        raise APIError(501, "this server has no tokenizer loaded in its frontend", SERVER_ERROR)
    return preprocessor


def _check_model(body: dict[str, Any], ctx: ServingContext) -> None:
    model = get_str(body, "model", ctx.served_model_name)
    if model != ctx.served_model_name:
        raise model_not_found(model)


def _tokenize_sync(preprocessor: Preprocessor, body: dict[str, Any]) -> list[int]:
    if body.get("messages") is not None:
        messages = parse_messages(body["messages"])
        kwargs = get_object(body, "chat_template_kwargs") or {}
        text = preprocessor.render_chat(
            messages, get_bool(body, "add_generation_prompt", True), dict(kwargs)
        )
        add_special = get_bool(body, "add_special_tokens", False)
        return preprocessor.tokenizer.encode(text, add_special_tokens=add_special).ids
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("'prompt' (a string) or 'messages' is required", "prompt")
    add_special = get_bool(body, "add_special_tokens", True)
    return preprocessor.tokenizer.encode(prompt, add_special_tokens=add_special).ids


async def tokenize(
    ctx: ServingContext, preprocessor: Preprocessor | None, body: Any
) -> web.Response:
    preprocessor = _require_tokenizer(preprocessor)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _check_model(body, ctx)
    size = len(str(body.get("prompt") or "")) + len(str(body.get("messages") or ""))
    if size > _INLINE_TOKENIZE_CHARS:
        ids = await asyncio.to_thread(_tokenize_sync, preprocessor, body)
    else:
        ids = _tokenize_sync(preprocessor, body)
    result: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
    if get_bool(body, "return_token_strs", False):
        result["token_strs"] = [preprocessor.tokenizer.id_to_token(i) for i in ids]
    else:
        result["token_strs"] = None
    return json_response(result)


async def detokenize(
    ctx: ServingContext, preprocessor: Preprocessor | None, body: Any
) -> web.Response:
    preprocessor = _require_tokenizer(preprocessor)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _check_model(body, ctx)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise invalid("'tokens' must be a list of token ids", "tokens")
    check_token_ids(tokens, preprocessor.vocab_size, "tokens")
    text = preprocessor.tokenizer.decode(tokens, skip_special_tokens=False)
    return json_response({"prompt": text})
