"""The aiohttp application: OpenAI routes, and one middleware that turns every failure into an
OpenAI error body, so that no request can take the server down.

The engine client is injected (``create_app(config, engine)``), so the HTTP layer is tested
against a fake engine without any process tree.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from frontend_proc import jsonutil, routes_misc
from frontend_proc.engine_client import EngineClientProtocol
from frontend_proc.errors import INVALID_REQUEST, SERVER_ERROR, APIError, error_body, invalid
from frontend_proc.gate import make_gate, retry_after
from frontend_proc.sampling_defaults import SamplingDefaults
from frontend_proc.server_state import ServerState
from frontend_proc.serving_chat import create_chat_completion
from frontend_proc.serving_common import ServingContext, json_response
from frontend_proc.serving_completions import create_completion
from frontend_proc.serving_responses import create_response, stored_response
from frontend_proc.tokenizer_calls import InProcessTokenizer, TokenizerService
from pegainfer.config import EngineConfig

if TYPE_CHECKING:
    from frontend_proc.preprocess import Preprocessor

logger = logging.getLogger(__name__)

CONTEXT_KEY = web.AppKey("serving_context", ServingContext)
STATE_KEY = web.AppKey("server_state", ServerState)
TOKENIZER_KEY = web.AppKey("tokenizer", object)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _http_error_message(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"Invalid URL ({request.method} {request.path})"
    if exc.status == 405:
        return f"Method {request.method} is not allowed for {request.path}"
    # aiohttp's own errors (413 for a body over client_max_size, ...) say what went wrong in
    # their text; the bare ones only repeat the status line.
    return exc.text or exc.reason or f"HTTP {exc.status}"


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        if exc.status == 503:  # refused by design (draining, overload, a dead engine)
            logger.info("%s %s refused: %s", request.method, request.path, exc.message)
        elif exc.status >= 500:
            logger.error("%s %s failed: %s", request.method, request.path, exc.message)
        return json_response(exc.body(), exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error_type = SERVER_ERROR if exc.status >= 500 else INVALID_REQUEST
        response = json_response(
            error_body(_http_error_message(request, exc), error_type), exc.status
        )
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client is gone; there is no one to answer
    except Exception:
        logger.exception("%s %s failed", request.method, request.path)
        return json_response(error_body("internal server error", SERVER_ERROR), 500)


async def read_json(request: web.Request) -> Any:
    data = await request.read()
    if not data:
        raise invalid("the request body is empty; it must be a JSON object")
    try:
        return jsonutil.loads(data)
    except ValueError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from None


async def health(request: web.Request) -> web.Response:
    return routes_misc.health_response(request.app[STATE_KEY], request.app[CONTEXT_KEY].engine)


async def version(request: web.Request) -> web.Response:
    return routes_misc.version_response()


async def metrics(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    return routes_misc.metrics_response(ctx, request.app[STATE_KEY], ctx.engine)


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    cards = [routes_misc.model_card(ctx, name) for name in ctx.served_model_names]
    return json_response({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    return routes_misc.get_model(request.app[CONTEXT_KEY], request.match_info["model"])


async def tokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    return await routes_misc.tokenize(request.app[CONTEXT_KEY], request.app[TOKENIZER_KEY], body)


async def detokenize(request: web.Request) -> web.Response:
    body = await read_json(request)
    return await routes_misc.detokenize(request.app[CONTEXT_KEY], request.app[TOKENIZER_KEY], body)


async def reset_prefix_cache(request: web.Request) -> web.Response:
    return await routes_misc.reset_prefix_cache(request.app[CONTEXT_KEY].engine)


async def responses(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await create_response(request, request.app[CONTEXT_KEY], body)


async def get_response(request: web.Request) -> web.Response:
    raise stored_response(request.match_info["response_id"])


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await create_completion(request, request.app[CONTEXT_KEY], body)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await create_chat_completion(request, request.app[CONTEXT_KEY], body)


def create_app(
    config: EngineConfig,
    engine: EngineClientProtocol,
    preprocessor: Preprocessor | None = None,
    state: ServerState | None = None,
    reasoning: bool | None = None,
    tokenizer: TokenizerService | None = None,
) -> web.Application:
    """``tokenizer`` serves /tokenize and /detokenize (the server passes its engine client,
    which asks the tokenizer processes). A ``preprocessor`` instead serves them in this
    process, and tells whether the model reasons in ``<think>`` blocks (``reasoning``
    overrides that)."""
    max_model_len = config.max_model_len
    if max_model_len <= 0 and config.model is not None:
        max_model_len = config.model.longest_context()
    state = state or ServerState.from_config(config)
    app = web.Application(
        middlewares=[retry_after, error_middleware, make_gate(state, engine)],
        client_max_size=state.max_request_bytes,
    )
    if reasoning is None:
        reasoning = preprocessor is not None and preprocessor.reasoning
    if tokenizer is None and preprocessor is not None:
        tokenizer = InProcessTokenizer(preprocessor)
    app[CONTEXT_KEY] = ServingContext(
        served_model_name=config.served_model_name,
        model_path=config.model_path,
        max_model_len=max_model_len,
        engine=engine,
        reasoning=reasoning,
        vocab_size=config.model.vocab_size if config.model is not None else None,
        sampling_defaults=SamplingDefaults.from_dict(config.sampling_defaults),
        max_logprobs=config.max_logprobs,
        cache_block_size=config.block_size if config.enable_prefix_caching else 0,
        model_aliases=tuple(config.served_model_aliases),
    )
    app[STATE_KEY] = state
    app[TOKENIZER_KEY] = tokenizer
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    # vLLM's name, and SGLang's.
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/flush_cache", reset_prefix_cache)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    return app
