"""The frontend's own state beyond the engine: draining, limits, and the drain itself.

Limits come from the launcher's command line through ``config.extra``:

- ``api_keys``: list of accepted Bearer keys (empty: no auth);
- ``max_request_bytes``: largest request body;
- ``max_waiting_requests``: refuse generation requests (503) while this many wait (-1: off);
- ``shutdown_timeout``: how long a drain lets requests finish (the launcher sends it, too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pegainfer.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 64 * 1024 * 1024
# After the drain deadline, aborted requests get this long to come back as "abort".
ABORT_GRACE_S = 3.0
# And handlers this long to write their last bytes before the frontend reports drained.
WRITE_GRACE_S = 1.0


@dataclass
class ServerState:
    api_keys: list[bytes] = field(default_factory=list)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_waiting_requests: int = -1
    max_num_seqs: int = 256
    draining: bool = False
    num_http_in_flight: int = 0  # generation handlers still running
    drain_task: asyncio.Task[None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> ServerState:
        extra = config.extra or {}
        keys = extra.get("api_keys") or []
        max_bytes = extra.get("max_request_bytes") or DEFAULT_MAX_REQUEST_BYTES
        max_waiting = extra.get("max_waiting_requests")
        return cls(
            api_keys=[key.encode() for key in keys if isinstance(key, str) and key],
            max_request_bytes=int(max_bytes) if int(max_bytes) > 0 else DEFAULT_MAX_REQUEST_BYTES,
            max_waiting_requests=int(max_waiting) if isinstance(max_waiting, int) else -1,
            max_num_seqs=config.max_num_seqs,
        )


def dead_reason(engine: Any) -> str | None:
    return getattr(engine, "dead_reason", None)


def waiting_estimate(engine: Any, max_num_seqs: int) -> int:
    """Requests waiting for the engine, as far as the frontend can tell: the scheduler's
    last report, or the requests this frontend sent that have produced nothing yet, minus
    the running slots still free (those may be admitted at once)."""
    stats = getattr(engine, "stats", None)
    reported_waiting = stats.num_waiting if stats is not None else 0
    running = stats.num_running if stats is not None else 0
    unstarted = getattr(engine, "num_unstarted", 0)
    return max(reported_waiting, unstarted - max(0, max_num_seqs - running))


async def drain(state: ServerState, engine: Any, timeout: float) -> None:
    """Refuse new work, let what is in flight finish for up to ``timeout`` seconds, abort
    the rest (clients see finish_reason "abort"), then tell the launcher."""
    loop = asyncio.get_running_loop()
    state.draining = True
    started = time.monotonic()
    initial = engine.num_active
    logger.info("draining: %d requests in flight, waiting up to %.1f s", initial, timeout)

    async def wait_until(deadline: float, done) -> bool:
        while not done():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    idle = await wait_until(loop.time() + timeout, lambda: engine.num_active == 0)
    aborted = 0
    if not idle:
        ids = engine.active_request_ids()
        aborted = len(ids)
        logger.warning("drain timeout: aborting %d requests", aborted)
        engine.abort(ids)
        if not await wait_until(loop.time() + ABORT_GRACE_S, lambda: engine.num_active == 0):
            engine.fail_all("the server is shutting down")
    await wait_until(loop.time() + WRITE_GRACE_S, lambda: state.num_http_in_flight == 0)
    logger.info(
        "drained in %.2f s: %d requests finished, %d aborted",
        time.monotonic() - started,
        initial - aborted,
        aborted,
    )
    engine.send_drained(initial - aborted, aborted)


def start_drain(state: ServerState, engine: Any, timeout: float) -> None:
    """Called from the engine client's receiver when the launcher asks for a drain."""
    if state.drain_task is not None:
        return
    state.drain_task = asyncio.get_running_loop().create_task(drain(state, engine, timeout))
