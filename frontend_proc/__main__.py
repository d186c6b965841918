"""The frontend process: ``python -m frontend_proc --run-dir DIR``.

The launcher starts it with the workers, so that its imports overlap the model load; it
waits until the scheduler is up (pegainfer/config.py's start stages), binds the engine
sockets, then the HTTP port, and only then reports ready: the launcher treats that report as
"the server is up".
"""

from __future__ import annotations

import asyncio
import logging

import uvloop
import zmq
from aiohttp import web

from frontend_proc.app import create_app
from frontend_proc.engine_client import EngineClient
from frontend_proc.server_state import ServerState, start_drain
from pegainfer.config import STAGE_SCHEDULER_READY, EngineConfig
from pegainfer.gc_control import settle_heap
from pegainfer.process import child_args, init_child, report_ready

logger = logging.getLogger(__name__)

NAME = "frontend"


async def serve(config: EngineConfig, run_dir: str) -> None:
    engine = EngineClient(run_dir)
    state = ServerState.from_config(config)
    engine.on_drain = lambda timeout: start_drain(state, engine, timeout)
    engine.start()
    # No tokenizer here: /tokenize and /detokenize are calls to the tokenizer processes, and
    # the launcher learned from them whether the model reasons in <think> blocks.
    app = create_app(config, engine, state=state, reasoning=config.reasoning, tokenizer=engine)
    # handler_cancellation: a client that disconnects cancels its handler, whose cleanup then
    # aborts its requests in the engine.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    # Before the port opens: after it, a full collection (about 10 ms) would hold up
    # whatever request came in first.
    settle_heap(NAME)
    site = web.TCPSite(runner, config.host, config.port, backlog=1024)
    await site.start()
    addresses = runner.addresses
    port = addresses[0][1] if addresses else config.port
    logger.info("serving %s on http://%s:%d", config.served_model_name, config.host, port)
    sync_ctx = zmq.Context()
    report_ready(sync_ctx, run_dir, NAME, settle=False, host=config.host, port=port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await engine.close()


def main() -> None:
    args = child_args("pegainfer HTTP frontend")
    config = init_child(NAME, args.run_dir, STAGE_SCHEDULER_READY)
    uvloop.run(serve(config, args.run_dir))


if __name__ == "__main__":
    main()
