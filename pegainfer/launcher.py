"""Starts the process tree, waits for it to be ready, watches it, and tears it down.

Start order: every process is spawned at once, so that the light ones' interpreters and
imports overlap the model load; the scheduler then waits until the workers have reported the
size of the KV cache, and the frontend (and so the HTTP port) until every other process is
ready. The launcher tells them through the start stage it records in the run directory's
config.json. If any child dies, the rest are stopped and the launcher exits
non-zero naming it. SIGINT and SIGTERM stop the whole tree. The run directory, with its
sockets, is removed in every case.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from frontend_proc.reasoning import check_reasoning_parser
from frontend_proc.sampling_defaults import resolve_sampling_defaults
from frontend_proc.tool_calls import check_tool_call_parser
from pegainfer import ipc, lifecycle, multinode, protocol
from pegainfer.bytecode_cache import (
    BYTECODE_CACHE_ENV,
    bytecode_cache_for_children,
    filled_note,
    start_filling,
)
from pegainfer.config import (
    STAGE_LAUNCHED,
    STAGE_SCHEDULER_READY,
    STAGE_WORKERS_READY,
    EngineConfig,
    finalize,
    read_model_info,
)
from pegainfer.hub_cache import is_repo_id, resolve_model_path
from pegainfer.manifest import write_manifest
from pegainfer.process import PARENT_PID_ENV, set_process_title, setup_logging
from pegainfer.startup_timeline import seconds_since_process_start

logger = logging.getLogger("pegainfer.launcher")

STOP_GRACE_SECONDS = 5.0


class ChildDied(RuntimeError):
    pass


class StopRequested(Exception):
    pass


class ProcessTree:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.run_dir = config.run_dir
        # "Launch" is the launcher process's creation, so its own imports count too.
        self.started = time.monotonic() - (seconds_since_process_start() or 0.0)
        self.children: dict[str, subprocess.Popen] = {}
        self.child_env = dict(os.environ)
        self.child_env[PARENT_PID_ENV] = str(os.getpid())
        self.child_env.setdefault("PYTHONUNBUFFERED", "1")
        bytecode = bytecode_cache_for_children(self.child_env)
        # A first start fills the cache beside the processes (pegainfer/bytecode_warm.py).
        self.bytecode_filler: subprocess.Popen | None = None
        if bytecode is not None:
            logger.info(
                "PYTHONDONTWRITEBYTECODE is set: the processes keep their bytecode in %s "
                "(%s=0 compiles every import from source instead)",
                bytecode,
                BYTECODE_CACHE_ENV,
            )
            filling = start_filling(bytecode, self.child_env)
            if filling is not None:
                self.bytecode_filler, processes = filling
                logger.info(
                    "first start with that cache: filling it with the workers' imports on %d "
                    "processes (pid %d)",
                    processes,
                    self.bytecode_filler.pid,
                )
        self.ready: dict[str, protocol.ProcessReady] = {}
        self.ctx = zmq.Context()
        self.control = ipc.bind(self.ctx, zmq.PULL, self.run_dir, "launcher")
        self.stop_signal: int | None = None
        self.failure: str | None = None  # why the tree stops, when a child failed
        # Node 0 of several: the headless nodes' launchers report to this link.
        self.link = None
        if config.nnodes > 1 and not config.headless:
            from pegainfer.node_link import NodeLinkServer

            self.link = NodeLinkServer(self.ctx, config)

    # -- children ---------------------------------------------------------

    def spawn(self, name: str, module: str, *args: str) -> None:
        cmd = [sys.executable, "-m", module, "--run-dir", self.run_dir, *args]
        self.children[name] = subprocess.Popen(cmd, env=self.child_env, stdin=subprocess.DEVNULL)
        logger.debug("started %s (pid %d): %s", name, self.children[name].pid, " ".join(cmd))
        write_manifest(self.config, self.children)

    def check_children(self) -> None:
        if self.stop_signal is not None:
            raise StopRequested
        dead = [(name, proc, proc.poll()) for name, proc in self.children.items()]
        dead = [(name, proc, code) for name, proc, code in dead if code is not None]
        if dead:
            # Several may be found dead at once when one death takes others with it (a
            # killed rank makes its peers' collectives fail): name the killed one first.
            dead.sort(key=lambda entry: entry[2] >= 0)
            described = [f"pegainfer::{n} (pid {p.pid}) {_describe_exit(c)}" for n, p, c in dead]
            also = f" (then {', '.join(described[1:])})" if len(described) > 1 else ""
            raise ChildDied(f"process {described[0]}{also}")

    def _poll_link(self) -> list[protocol.ProcessReady]:
        """The ready messages of other nodes' workers; a lost node is a dead child."""
        if self.link is None:
            return []
        from pegainfer.node_link import NodeLost

        try:
            ready = self.link.poll()
            self.link.check()
        except NodeLost as exc:
            raise ChildDied(str(exc)) from None
        return ready

    def wait_ready(self, names: list[str]) -> None:
        waiting = set(names) - set(self.ready)
        while waiting:
            self.check_children()
            msg = ipc.recv(self.control, (protocol.ProcessReady,), "launcher", timeout_ms=100)
            for ready in ([msg] if msg is not None else []) + self._poll_link():
                self.ready[ready.name] = ready
                waiting.discard(ready.name)
                logger.info(
                    "%s ready (pid %d) %.2f s after launch",
                    ready.name,
                    ready.pid,
                    time.monotonic() - self.started,
                )

    def stop(self) -> None:
        if self.link is not None:
            from pegainfer.node_link import STOPPED

            self.link.close(self.failure or STOPPED)
        alive = [p for p in self.children.values() if p.poll() is None]
        if self.bytecode_filler is not None and self.bytecode_filler.poll() is None:
            alive.append(self.bytecode_filler)  # it keeps nothing: stopped with the rest
        for proc in alive:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait()
        self.control.close()
        self.ctx.term()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- lifecycle --------------------------------------------------------

    def start(self) -> None:
        config = self.config
        t0 = self.started
        worker_names = [f"worker-{rank}" for rank in range(config.tensor_parallel_size)]
        for rank in multinode.local_ranks(config):  # other nodes start their own ranks
            self.spawn(f"worker-{rank}", "worker_proc", "--rank", str(rank))
        self.spawn("detokenizer", "detokenizer_proc")
        tokenizer_names = [f"tokenizer-{i}" for i in range(config.num_tokenizers)]
        for i, name in enumerate(tokenizer_names):
            self.spawn(name, "frontend_proc.tokenizer_proc", "--index", str(i))
        # Started now, they import while the workers load, then wait for their stage.
        self.spawn("scheduler", "scheduler_proc")
        self.spawn("frontend", "frontend_proc")
        self.wait_ready(worker_names)

        # Ranks may size their caches differently (profiled per GPU): plan for the smallest.
        config.num_kv_blocks = min(int(self.ready[n].info["num_kv_blocks"]) for n in worker_names)
        config.start_stage = STAGE_WORKERS_READY
        config.save(self.run_dir)
        self.wait_ready(["detokenizer", *tokenizer_names, "scheduler"])

        # The frontend loads no tokenizer; a tokenizer tells whether the model reasons.
        config.reasoning = bool(self.ready[tokenizer_names[0]].info.get("reasoning", False))
        config.start_stage = STAGE_SCHEDULER_READY
        config.save(self.run_dir)
        self.wait_ready(["frontend"])
        if self.bytecode_filler is not None:
            code = self.bytecode_filler.poll()
            if code is None:
                logger.info("bytecode cache: still filling")
            elif code == 0:
                logger.info(
                    "bytecode cache: %s", filled_note(self.child_env["PYTHONPYCACHEPREFIX"])
                )
            else:
                logger.warning("bytecode cache: its filler %s", _describe_exit(code))
        logger.info(
            "serving %s on http://%s:%d/v1 (ready in %.1f s; run dir %s)",
            config.served_model_name,
            config.host,
            config.port,
            time.monotonic() - t0,
            self.run_dir,
        )

    def watch(self) -> None:
        while True:
            self.check_children()
            self._poll_link()
            for msg in ipc.drain(self.control, lifecycle.CONTROL_MESSAGES, "launcher"):
                if isinstance(msg, protocol.WatchdogAlarm):
                    raise ChildDied(lifecycle.watchdog_fired(self, msg))
            time.sleep(0.1)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _signal(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


def make_run_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.access(base, os.W_OK):
        base = tempfile.gettempdir()
    # mkdtemp creates the directory with mode 0700: only this user can reach the sockets.
    return tempfile.mkdtemp(prefix=f"pegainfer-{os.getpid()}-", dir=base)


def resolve_model(config: EngineConfig) -> EngineConfig:
    if not config.model_path:
        from pegainfer.default_model import default_model_dir

        config.model_path = default_model_dir()
    if is_repo_id(config.model_path):
        # Served under its Hub name, as clients of other servers address it.
        config.served_model_name = config.served_model_name or config.model_path
        config.model_path = resolve_model_path(config.model_path, config.revision)
        logger.info("serving %s from %s", config.served_model_name, config.model_path)
    config.model_path = os.path.abspath(config.model_path)
    config.model = read_model_info(config.model_path, config.hf_overrides)
    check_reasoning_parser(config.model_path, config.reasoning_parser)
    if config.tool_call_parser != "auto":
        from frontend_proc.chat_template import ChatTemplate  # jinja2: only when asked

        template = ChatTemplate.load(config.model_path, config.chat_template)
        check_tool_call_parser(config.tool_call_parser, template and template.source)
    if not config.served_model_name:
        config.served_model_name = os.path.basename(config.model_path.rstrip("/"))
    config.sampling_defaults, notes = resolve_sampling_defaults(
        config.generation_config, config.model_path, config.generation_config_override
    )
    for note in notes:
        logger.info("%s", note)
    return finalize(config)


def serve(config: EngineConfig) -> int:
    """Run the tree until it is stopped; the process exit code."""
    set_process_title("launcher")
    setup_logging("launcher", config.log_level)
    try:
        config = resolve_model(config)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        logger.error("cannot serve the model: %s", exc)
        return 2
    try:
        multinode.check_layout(config)
        multinode.check_tensor_parallel(
            config.model_path, config.tensor_parallel_size, config.hf_overrides
        )
    except (OSError, ValueError, KeyError) as exc:
        logger.error("cannot shard the model: %s", exc)
        return 2
    if config.headless:
        from pegainfer.node_link import serve_headless

        return serve_headless(config)
    config.run_dir = make_run_dir()
    config.start_stage = STAGE_LAUNCHED
    config.save(config.run_dir)

    try:
        tree = ProcessTree(config)
    except zmq.ZMQError as exc:  # the node link's port: taken, or not an address of ours
        logger.error("cannot listen for the other nodes: %s", exc)
        shutil.rmtree(config.run_dir, ignore_errors=True)
        return 2

    def on_signal(signum: int, _frame) -> None:
        tree.stop_signal = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        tree.start()
        tree.watch()
    except StopRequested:
        logger.info("%s received: stopping", signal.Signals(tree.stop_signal).name)
        if tree.stop_signal == signal.SIGTERM:
            lifecycle.drain_frontend(tree, lifecycle.shutdown_timeout(config.extra))
        return 0
    except ChildDied as exc:
        logger.error("%s; stopping the tree", exc)
        tree.failure = str(exc)
        lifecycle.notify_engine_death(tree, str(exc))
        return 1
    finally:
        tree.stop()
        logger.info("stopped")
    return 0
