"""ZeroMQ sockets between the processes of one instance.

Every socket is an ``ipc://`` file in the instance's private run directory. Each inbound
socket is a PULL bound by its owner; senders connect PUSH sockets to it. ZeroMQ lets a PUSH
connect before the PULL binds, so processes can start in any order.

| socket        | bound by (PULL)        | senders                                   |
|---------------|------------------------|-------------------------------------------|
| launcher      | launcher               | every child: ProcessReady                 |
| tokenizer     | frontend binds a PUSH  | tokenizers connect PULL: GenerateRequest  |
| scheduler     | scheduler              | tokenizers, frontend, worker rank 0       |
| worker-{rank} | worker rank            | scheduler: StepPlan                       |
| detokenizer   | detokenizer            | scheduler: TokenOutputs                   |
| frontend      | frontend               | detokenizer, tokenizers, scheduler        |
"""

from __future__ import annotations

import logging
import os
from typing import Any

import zmq

from pegainfer import protocol

logger = logging.getLogger(__name__)

SOCKET_TABLE: list[dict[str, str]] = [
    {"name": "launcher", "bound_by": "launcher", "pattern": "PULL", "carries": "ProcessReady"},
    {
        "name": "tokenizer",
        "bound_by": "frontend",
        "pattern": "PUSH",
        "carries": "GenerateRequest (round-robin to tokenizers)",
    },
    {
        "name": "scheduler",
        "bound_by": "scheduler",
        "pattern": "PULL",
        "carries": "TokenizedRequest, AbortRequests, StepResult",
    },
    {"name": "worker-{rank}", "bound_by": "worker", "pattern": "PULL", "carries": "StepPlan"},
    {
        "name": "detokenizer",
        "bound_by": "detokenizer",
        "pattern": "PULL",
        "carries": "TokenOutputs",
    },
    {
        "name": "frontend",
        "bound_by": "frontend",
        "pattern": "PULL",
        "carries": "TextOutputs, RequestRejected",
    },
]


def address(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name + '.sock')}"


def _configure(sock: zmq.Socket) -> None:
    # Exiting must never block on unsent messages, and a PUSH must queue rather than drop.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)


def bind(ctx: zmq.Context, kind: int, run_dir: str, name: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    _configure(sock)
    sock.bind(address(run_dir, name))
    return sock


def connect(ctx: zmq.Context, kind: int, run_dir: str, name: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    _configure(sock)
    sock.connect(address(run_dir, name))
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(protocol.encode(msg), copy=False)


def decode_or_drop(data: bytes, expected: tuple[type, ...] | None, where: str) -> Any | None:
    """Decode one message; a malformed one is logged and dropped, never raised."""
    try:
        return protocol.decode(data, expected)
    except protocol.ProtocolError as exc:
        logger.warning("dropped a malformed message on %s: %s", where, exc)
        return None


def recv(
    sock: zmq.Socket, expected: tuple[type, ...] | None, where: str, timeout_ms: int | None = None
) -> Any | None:
    """Receive one valid message, or None on timeout (malformed messages are dropped)."""
    if timeout_ms is not None and not sock.poll(timeout_ms):
        return None
    return decode_or_drop(sock.recv(copy=True), expected, where)


def drain(sock: zmq.Socket, expected: tuple[type, ...] | None, where: str) -> list[Any]:
    """Every message already waiting on the socket, without blocking."""
    messages = []
    while True:
        try:
            data = sock.recv(flags=zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return messages
        msg = decode_or_drop(data, expected, where)
        if msg is not None:
            messages.append(msg)
