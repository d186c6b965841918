"""ZeroMQ sockets between the processes of one instance.

Every socket is an ``ipc://`` file in the instance's private run directory. Each inbound
socket is a PULL bound by its owner; senders connect PUSH sockets to it. ZeroMQ lets a PUSH
connect before the PULL binds, so processes can start in any order.

| socket        | bound by (PULL)        | senders                                   |
|---------------|------------------------|-------------------------------------------|
| launcher      | launcher               | every child: ProcessReady; frontend:      |
|               |                        | Drained; scheduler: WatchdogAlarm         |
| tokenizer     | frontend binds a PUSH  | tokenizers connect PULL: GenerateRequest, |
|               |                        | TokenizeRequest, DetokenizeRequest        |
| scheduler     | scheduler              | tokenizers, frontend (aborts, prefix      |
|               |                        | cache resets), worker rank 0, detokenizer |
|               |                        | (aborts on stop strings)                  |
| worker-{rank} | worker rank            | scheduler: StepPlan                       |
| detokenizer   | detokenizer            | scheduler: TokenOutputs                   |
| frontend      | frontend               | detokenizer, tokenizers (also answers to  |
|               |                        | /tokenize calls), scheduler (also answers |
|               |                        | to resets), launcher (Drain, EngineDead)  |
| tap-{process} | every child (PUB)      | a copy of every message the process sends |

The tap sockets let ``pegainfer tap`` watch the traffic of a running instance. A PUB socket
drops messages while nobody subscribes, and drops rather than blocks when a subscriber is
slow, so the server never waits for a tap.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import zmq

from pegainfer import protocol

logger = logging.getLogger(__name__)

SOCKET_TABLE: list[dict[str, str]] = [
    {
        "name": "launcher",
        "bound_by": "launcher",
        "pattern": "PULL",
        "carries": "ProcessReady, Drained, WatchdogAlarm",
    },
    {
        "name": "tokenizer",
        "bound_by": "frontend",
        "pattern": "PUSH",
        "carries": "GenerateRequest, TokenizeRequest, DetokenizeRequest (round-robin to "
        "tokenizers)",
    },
    {
        "name": "scheduler",
        "bound_by": "scheduler",
        "pattern": "PULL",
        "carries": "TokenizedRequest, AbortRequests, StepResult, ResetPrefixCache",
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
        "carries": "TextOutputs, RequestRejected, EngineStats, Drain, EngineDead, "
        "TokenizeResult, DetokenizeResult, PrefixCacheReset",
    },
    {
        "name": "tap-{process}",
        "bound_by": "every child",
        "pattern": "PUB",
        "carries": "a copy of every message the process sends: [source>destination, message]",
    },
]

# How many messages a tap subscriber may fall behind before the tap drops for it.
TAP_HWM = 10_000
# The socket name each of our sockets connects or binds to, for the tap's labels.
_socket_names: weakref.WeakKeyDictionary[zmq.Socket, str] = weakref.WeakKeyDictionary()
_tap: _Tap | None = None


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
    _socket_names[sock] = name
    return sock


def connect(ctx: zmq.Context, kind: int, run_dir: str, name: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    _configure(sock)
    sock.connect(address(run_dir, name))
    _socket_names[sock] = name
    return sock


def bind_url(ctx: zmq.Context, kind: int, url: str, name: str) -> zmq.Socket:
    """``bind`` to an explicit address (a ``tcp://`` one between nodes, see multinode)."""
    sock = ctx.socket(kind)
    _configure(sock)
    sock.bind(url)
    _socket_names[sock] = name
    return sock


def connect_url(ctx: zmq.Context, kind: int, url: str, name: str) -> zmq.Socket:
    """``connect`` to an explicit address (a ``tcp://`` one between nodes, see multinode)."""
    sock = ctx.socket(kind)
    _configure(sock)
    sock.connect(url)
    _socket_names[sock] = name
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    data = protocol.encode(msg)
    sock.send(data, copy=False)
    if _tap is not None:
        _tap.publish(_socket_names.get(sock, "?"), data)


def mirror(sock: zmq.Socket, data: bytes) -> None:
    """Copy an already encoded message sent on ``sock`` to the tap (for callers that send
    the bytes themselves, e.g. one plan encoded once for every worker rank)."""
    if _tap is not None:
        _tap.publish(_socket_names.get(sock, "?"), data)


class _Tap:
    """This process's tap: a PUB socket that publishes ``[b"source>destination", message]``."""

    def __init__(self, run_dir: str, process: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, TAP_HWM)
        self.sock.bind(address(run_dir, tap_socket_name(process)))
        self.prefix = process.encode() + b">"
        self.failed = False

    def publish(self, destination: str, data: bytes) -> None:
        try:
            self.sock.send_multipart(
                [self.prefix + destination.encode(), data], flags=zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as exc:  # the tap must never cost the server anything
            if not self.failed:
                self.failed = True
                logger.warning("the tap stopped publishing: %s", exc)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def tap_socket_name(process: str) -> str:
    return f"tap-{process}"


def enable_tap(run_dir: str, process: str) -> None:
    """Publish a copy of every message this process sends on its tap socket."""
    global _tap
    if _tap is not None:
        return
    try:
        _tap = _Tap(run_dir, process)
    except zmq.ZMQError as exc:  # e.g. a second copy of a process started by hand
        logger.warning("no tap for %s: %s", process, exc)


def disable_tap() -> None:
    global _tap
    if _tap is not None:
        _tap.close()
        _tap = None


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
