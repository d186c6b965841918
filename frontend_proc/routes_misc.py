"""The endpoints around generation: /health, /version, /metrics, /v1/models/{id}, and
/tokenize and /detokenize (answered by a tokenizer process: the frontend loads no tokenizer)."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from aiohttp import web

from frontend_proc import metrics
from frontend_proc.errors import SERVER_ERROR, APIError, error_body, invalid, model_not_found
from frontend_proc.fields import check_token_ids, get_bool, get_object, get_str
from frontend_proc.messages import parse_messages
from frontend_proc.schemas import render_options
from frontend_proc.server_state import ServerState, dead_reason
from frontend_proc.serving_common import ServingContext, json_response, new_request_id
from frontend_proc.tokenizer_calls import TokenizerService
from frontend_proc.tool_calls import parse_tools
from frontend_proc.unsupported import refuse_request_chat_template
from pegainfer.protocol import DetokenizeRequest, TokenizeRequest, pack_ids, unpack_ids


def model_card(ctx: ServingContext, name: str | None = None) -> dict[str, Any]:
    return {
        "id": name or ctx.served_model_name,
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
    if model not in ctx.served_model_names:
        raise model_not_found(model)
    return json_response(model_card(ctx, model))


async def reset_prefix_cache(engine: Any) -> web.Response:
    """POST /reset_prefix_cache (and /flush_cache): empty the prefix cache, so that the next
    requests compute their prompts in full (a benchmark's cold runs, say)."""
    reset = await engine.reset_prefix_cache()
    return json_response(
        {
            "object": "prefix_cache_reset",
            "enabled": reset.enabled,
            "num_entries": reset.num_entries,
            "num_blocks_freed": reset.num_blocks_freed,
        }
    )


def _require_tokenizer(tokenizer: TokenizerService | None) -> TokenizerService:
    if tokenizer is None:
        raise APIError(501, "this server has no tokenizer to serve this endpoint", SERVER_ERROR)
    return tokenizer


def _check_model(body: dict[str, Any], ctx: ServingContext) -> None:
    model = get_str(body, "model", ctx.served_model_name)
    if model not in ctx.served_model_names:
        raise model_not_found(model)


def tokenize_request(body: dict[str, Any]) -> TokenizeRequest:
    """The tokenizer call for a /tokenize body; a malformed body raises APIError."""
    messages = None
    prompt = None
    chat_template_kwargs: dict[str, Any] = {}
    add_generation_prompt, continue_final_message = True, False
    tools = None
    if body.get("messages") is not None:
        refuse_request_chat_template(body)
        messages = parse_messages(body["messages"])
        tools = parse_tools(body)
        chat_template_kwargs = dict(get_object(body, "chat_template_kwargs") or {})
        add_generation_prompt, continue_final_message = render_options(body)
        # The template writes every special token the model expects.
        add_special = get_bool(body, "add_special_tokens", False)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise invalid("'prompt' (a string) or 'messages' is required", "prompt")
        add_special = get_bool(body, "add_special_tokens", True)
    return TokenizeRequest(
        request_id=new_request_id("tokenize"),
        prompt=prompt,
        messages=messages,
        chat_template_kwargs=chat_template_kwargs,
        add_generation_prompt=add_generation_prompt,
        add_special_tokens=add_special,
        return_token_strs=get_bool(body, "return_token_strs", False),
        tools=tools,
        continue_final_message=continue_final_message,
    )


async def tokenize(
    ctx: ServingContext, tokenizer: TokenizerService | None, body: Any
) -> web.Response:
    tokenizer = _require_tokenizer(tokenizer)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _check_model(body, ctx)
    result = await tokenizer.tokenize(tokenize_request(body))
    ids = unpack_ids(result.token_ids)
    return json_response(
        {
            "count": len(ids),
            "max_model_len": ctx.max_model_len,
            "tokens": ids,
            "token_strs": result.token_strs,
        }
    )


async def detokenize(
    ctx: ServingContext, tokenizer: TokenizerService | None, body: Any
) -> web.Response:
    tokenizer = _require_tokenizer(tokenizer)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    _check_model(body, ctx)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise invalid("'tokens' must be a list of token ids", "tokens")
    # Checked here as well as by the tokenizer process: every id sent must fit int32.
    check_token_ids(tokens, ctx.vocab_size, "tokens")
    request = DetokenizeRequest(request_id=new_request_id("detokenize"), token_ids=pack_ids(tokens))
    result = await tokenizer.detokenize(request)
    return json_response({"prompt": result.text})
