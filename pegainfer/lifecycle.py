"""How the launcher ends a tree gracefully or under faults, kept out of the launcher's start
and watch logic.

- ``drain_frontend`` (SIGTERM): the frontend refuses new requests, lets those in flight
  finish for up to the shutdown timeout, aborts the rest, and answers ``Drained``.
- ``notify_engine_death`` (a child died): the frontend fails every request in flight at once
  and turns /health to 503, before the tree is taken down.
- ``watchdog_fired`` (a step stalled): every process dumps its Python stack (SIGUSR2, which
  ``init_child`` registers with faulthandler), then the tree is taken down.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

import zmq

from pegainfer import ipc, protocol

if TYPE_CHECKING:
    from pegainfer.launcher import ProcessTree

logger = logging.getLogger("pegainfer.launcher")

DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
# Beyond the drain timeout: aborted requests coming back, and the last bytes written.
DRAIN_GRACE_S = 5.0
# How long clients get to see the error of a dead engine before the frontend stops.
ERROR_DELIVERY_S = 0.5
# How long faulthandler gets to write every stack before the tree is stopped.
STACK_DUMP_S = 1.0

CONTROL_MESSAGES = (protocol.ProcessReady, protocol.Drained, protocol.WatchdogAlarm)


def shutdown_timeout(extra: dict[str, Any]) -> float:
    value = extra.get("shutdown_timeout", DEFAULT_SHUTDOWN_TIMEOUT_S)
    return float(value) if isinstance(value, (int, float)) and value >= 0 else 0.0


def _frontend(tree: ProcessTree) -> subprocess.Popen | None:
    proc = tree.children.get("frontend")
    if proc is None or proc.poll() is not None or "frontend" not in tree.ready:
        return None
    return proc


def _send_to_frontend(tree: ProcessTree, msg: Any) -> None:
    sock = ipc.connect(tree.ctx, zmq.PUSH, tree.run_dir, "frontend")
    try:
        ipc.send(sock, msg)
        time.sleep(0.02)  # LINGER is 0: let the message leave before the socket closes
    finally:
        sock.close(linger=500)


def _any_child_dead(tree: ProcessTree) -> str | None:
    for name, proc in tree.children.items():
        if proc.poll() is not None:
            return name
    return None


def drain_frontend(tree: ProcessTree, timeout: float) -> None:
    """Drain in-flight requests before the tree stops. A second SIGINT or SIGTERM, a dead
    child, or the deadline ends the wait early."""
    if _frontend(tree) is None:
        return
    interrupted = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: interrupted.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        logger.info("draining requests for up to %.1f s", timeout)
        _send_to_frontend(tree, protocol.Drain(timeout=timeout))
        deadline = time.monotonic() + timeout + DRAIN_GRACE_S
        while time.monotonic() < deadline:
            if interrupted:
                logger.info("second signal: stopping without waiting for the drain")
                return
            dead = _any_child_dead(tree)
            if dead is not None:
                logger.warning("%s exited during the drain", dead)
                return
            msg = ipc.recv(tree.control, CONTROL_MESSAGES, "launcher", timeout_ms=100)
            if isinstance(msg, protocol.Drained):
                logger.info(
                    "drained: %d requests finished, %d aborted", msg.num_finished, msg.num_aborted
                )
                return
        logger.warning("the frontend did not report a drain in time")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def notify_engine_death(tree: ProcessTree, reason: str) -> None:
    """Let the frontend fail its requests with ``reason`` before the tree goes down."""
    if _frontend(tree) is None:
        return
    try:
        _send_to_frontend(tree, protocol.EngineDead(reason=reason))
    except zmq.ZMQError as exc:
        logger.warning("could not tell the frontend: %s", exc)
        return
    time.sleep(ERROR_DELIVERY_S)


def watchdog_fired(tree: ProcessTree, alarm: protocol.WatchdogAlarm) -> str:
    """Dump every process's stack; returns the reason to stop the tree with."""
    reason = (
        f"watchdog: step {alarm.step_id} has been in flight for {alarm.seconds:.1f} s "
        f"(reported by {alarm.name})"
    )
    logger.error("%s; dumping the stack of every process", reason)
    for name, proc in tree.children.items():
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGUSR2)
                # A stopped process (SIGSTOP, a debugger detached) dumps once it runs again.
                proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:
                pass
            logger.info("asked pegainfer::%s (pid %d) for its stack", name, proc.pid)
    time.sleep(STACK_DUMP_S)
    return reason
