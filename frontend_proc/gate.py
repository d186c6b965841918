"""The middleware every request passes before its handler: API keys, body size, draining,
a dead engine and the waiting-queue limit. Refusals are OpenAI error bodies."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from frontend_proc.errors import SERVER_ERROR, APIError
from frontend_proc.server_state import ServerState, dead_reason, waiting_estimate

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Paths anyone may read, keys or not: probes and scrapers carry no keys.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/ping"})
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
RETRY_AFTER_S = "1"


def _key_matches(header: str | None, keys: list[bytes]) -> bool:
    if not header:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    presented = token.strip().encode()
    # Compare with every key, always: the time taken does not depend on which one matches.
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


class Unavailable(APIError):
    """A 503 that tells the client when to come back."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(503, message, SERVER_ERROR, None, code)


def make_gate(state: ServerState, engine: object) -> Callable:
    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if state.api_keys and path not in OPEN_PATHS:
            if not _key_matches(request.headers.get("Authorization"), state.api_keys):
                raise APIError(
                    401,
                    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
        length = request.content_length
        if length is not None and length > state.max_request_bytes:
            raise APIError(
                413,
                f"the request body of {length} bytes exceeds the limit of "
                f"{state.max_request_bytes} bytes",
                "invalid_request_error",
                None,
                "request_too_large",
            )
        if path not in GENERATION_PATHS or request.method != "POST":
            return await handler(request)
        reason = dead_reason(engine)
        if reason is not None:
            raise Unavailable(f"the engine is not available: {reason}", "engine_dead")
        if state.draining:
            raise Unavailable("the server is shutting down", "server_draining")
        if state.max_waiting_requests >= 0:
            waiting = waiting_estimate(engine, state.max_num_seqs)
            if waiting >= state.max_waiting_requests:
                raise Unavailable(
                    f"the server is overloaded: {waiting} requests are waiting "
                    f"(limit {state.max_waiting_requests}); retry later",
                    "server_overloaded",
                )
        state.num_http_in_flight += 1
        try:
            return await handler(request)
        finally:
            state.num_http_in_flight -= 1

    return gate


@web.middleware
async def retry_after(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Adds Retry-After to every 503 the inner layers produced."""
    response = await handler(request)
    if response.status == 503 and "Retry-After" not in response.headers:
        response.headers["Retry-After"] = RETRY_AFTER_S
    return response
