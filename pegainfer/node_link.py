"""The link between the launchers of a multi-node run, and the headless launcher.

Node 0's launcher binds a ROUTER on ``master_port + 1`` (on the master address only); the
launcher of each node k > 0 connects a DEALER named ``node-k``. Over it:

- node k says hello, forwards each of its workers' ``ProcessReady`` (node 0 starts the
  scheduler once every rank on every node is ready), and sends a heartbeat every second;
- node 0 sends a heartbeat every second;
- either side sends ``Shutdown`` when it stops, with the reason.

A launcher that hears nothing from the other side for ``NODE_TIMEOUT_S`` takes its own tree
down, so a host that vanishes (power, network) brings the whole run down instead of leaving
ranks waiting in a collective. Only ``ProcessReady`` and ``Shutdown`` travel here, encoded
and checked like every other message.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import zmq

from pegainfer import ipc, protocol
from pegainfer.config import EngineConfig
from pegainfer.multinode import link_url, local_ranks, node_of_rank

logger = logging.getLogger("pegainfer.launcher")

HEARTBEAT_S = 1.0
NODE_TIMEOUT_S = 30.0
# How long a headless node waits for node 0 to answer at all (node 0 may start later).
FIRST_CONTACT_TIMEOUT_S = 600.0
STOPPED = "node 0 stopped"
_ACCEPTED = (protocol.ProcessReady, protocol.Shutdown)


class NodeLost(RuntimeError):
    """The other side of the link failed, went silent, or stopped with an error."""


class StopFromNode0(Exception):
    """Node 0 stopped the run cleanly."""


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
    return sock


def _beat(name: str) -> protocol.ProcessReady:
    return protocol.ProcessReady(name=name, pid=os.getpid(), info={"kind": "heartbeat"})


class NodeLinkServer:
    """Node 0's end: one peer per node k > 0."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig) -> None:
        self.config = config
        self.sock = _socket(ctx, zmq.ROUTER)
        self.sock.bind(link_url(config))
        self.expected = {f"node-{k}" for k in range(1, config.nnodes)}
        self.last_seen: dict[str, float] = {}
        self._last_beat = 0.0

    def poll(self) -> list[protocol.ProcessReady]:
        """Handle what the nodes sent; returns their workers' ready messages. Raises
        ``NodeLost`` when a node reports that it stopped."""
        ready = []
        while True:
            try:
                frames = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 2:
                logger.warning("dropped a node link message of %d frames", len(frames))
                continue
            node = frames[0].decode(errors="replace")
            if node not in self.expected:
                logger.warning("dropped a message from unknown peer %r on the node link", node)
                continue
            msg = ipc.decode_or_drop(frames[1], _ACCEPTED, "node link")
            if msg is None:
                continue
            if node not in self.last_seen:
                logger.info("%s joined (launcher pid %s)", node, getattr(msg, "pid", "?"))
            self.last_seen[node] = time.monotonic()
            if isinstance(msg, protocol.Shutdown):
                raise NodeLost(f"{node} stopped: {msg.reason}")
            if msg.name.startswith("worker-") and self._rank_on(msg.name, node):
                ready.append(msg)
        self._heartbeat()
        return ready

    def _rank_on(self, worker: str, node: str) -> bool:
        try:
            rank = int(worker.removeprefix("worker-"))
        except ValueError:
            return False
        ok = 0 <= rank < self.config.tensor_parallel_size and (
            f"node-{node_of_rank(self.config, rank)}" == node
        )
        if not ok:
            logger.warning("%s reported %s, which is not one of its ranks", node, worker)
        return ok

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < HEARTBEAT_S:
            return
        self._last_beat = now
        data = protocol.encode(_beat("node-0"))
        for node in self.last_seen:
            self.sock.send_multipart([node.encode(), data])

    def check(self) -> None:
        now = time.monotonic()
        for node, seen in self.last_seen.items():
            if now - seen > NODE_TIMEOUT_S:
                raise NodeLost(f"{node} sent nothing for {now - seen:.0f} s")

    def close(self, reason: str) -> None:
        """Tell every node that joined to stop, then close."""
        data = protocol.encode(protocol.Shutdown(reason=reason))
        for node in self.last_seen:
            self.sock.send_multipart([node.encode(), data])
        self.sock.close(linger=1000)


class NodeLinkClient:
    """The end of a headless node k."""

    def __init__(self, ctx: zmq.Context, config: EngineConfig) -> None:
        self.name = f"node-{config.node_rank}"
        self.sock = _socket(ctx, zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, self.name.encode())
        self.sock.connect(link_url(config))
        self.started = time.monotonic()
        self.last_seen: float | None = None
        self._last_beat = 0.0
        hello = {"kind": "hello", "host": socket.gethostname(), "ranks": local_ranks(config)}
        ipc.send(self.sock, protocol.ProcessReady(name=self.name, pid=os.getpid(), info=hello))

    def forward(self, msg: protocol.ProcessReady) -> None:
        ipc.send(self.sock, msg)

    def poll(self) -> None:
        """Handle node 0's messages; raises ``StopFromNode0`` or ``NodeLost`` when it stops."""
        while True:
            try:
                data = self.sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = ipc.decode_or_drop(data, _ACCEPTED, "node link")
            if msg is None:
                continue
            if self.last_seen is None:
                logger.info("node 0 answered")
            self.last_seen = time.monotonic()
            if isinstance(msg, protocol.Shutdown):
                if msg.reason == STOPPED:
                    raise StopFromNode0(msg.reason)
                raise NodeLost(f"node 0 stopped: {msg.reason}")
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            ipc.send(self.sock, _beat(self.name))

    def check(self) -> None:
        now = time.monotonic()
        if self.last_seen is None:
            if now - self.started > FIRST_CONTACT_TIMEOUT_S:
                raise NodeLost(f"node 0 did not answer within {FIRST_CONTACT_TIMEOUT_S:.0f} s")
        elif now - self.last_seen > NODE_TIMEOUT_S:
            raise NodeLost(f"node 0 sent nothing for {now - self.last_seen:.0f} s")

    def close(self, reason: str | None) -> None:
        if reason is not None:
            ipc.send(self.sock, protocol.Shutdown(reason=reason))
        self.sock.close(linger=1000)


def serve_headless(config: EngineConfig) -> int:
    """Run this node's worker ranks under node 0 until either side stops; the exit code."""
    from pegainfer.launcher import ChildDied, ProcessTree, StopRequested, make_run_dir

    config.run_dir = make_run_dir()
    config.save(config.run_dir)
    tree = ProcessTree(config)

    def on_signal(signum: int, _frame) -> None:
        tree.stop_signal = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    link = NodeLinkClient(tree.ctx, config)
    names = [f"worker-{rank}" for rank in local_ranks(config)]
    node = f"node {config.node_rank}"
    reason: str | None = None
    try:
        for rank, name in zip(local_ranks(config), names):
            tree.spawn(name, "worker_proc", "--rank", str(rank))
        logger.info(
            "%s: started %s (run dir %s); node 0 at %s",
            node,
            ", ".join(names),
            config.run_dir,
            link_url(config),
        )
        forwarded: set[str] = set()
        while True:
            tree.check_children()
            link.poll()
            link.check()
            for msg in ipc.drain(tree.control, (protocol.ProcessReady,), "launcher"):
                if msg.name in names and msg.name not in forwarded:
                    link.forward(msg)
                    forwarded.add(msg.name)
                    logger.info("%s ready (pid %d)", msg.name, msg.pid)
                    if len(forwarded) == len(names):
                        logger.info("%s ready: its ranks wait for node 0's plans", node)
            time.sleep(0.05)
    except StopFromNode0:
        logger.info("node 0 stopped the run: stopping")
        return 0
    except StopRequested:
        logger.info("%s received: stopping", signal.Signals(tree.stop_signal).name)
        reason = f"{node} was stopped by {signal.Signals(tree.stop_signal).name}"
        return 0
    except (ChildDied, NodeLost) as exc:
        logger.error("%s; stopping %s", exc, node)
        reason = f"{node}: {exc}"
        return 1
    finally:
        link.close(reason)
        tree.stop()
        logger.info("stopped")
