"""Tensor-parallel group of this worker: its rank, the group size, and the collectives the
layers and the runner need.

With one rank every collective returns its input and torch.distributed is never touched.
With several, ``init_distributed`` joins a process group: NCCL on CUDA, gloo on CPU (so TP
correctness is testable without GPUs). On one node the rendezvous is a file in the run
directory; across nodes it is torch's TCP store on ``--master-addr:--master-port``, whose
listening socket is bound here, to that address only (torch's own store would listen on
every interface). Collectives' data sockets use the interface from ``pegainfer.multinode``.

Besides the model's collectives there is a small gloo group on the host, used once per step
by ``StepOrderCheck``: every rank must run the same plans in the same order, and a rank that
diverged must fail loudly instead of joining mismatched collectives (a hang under NCCL).
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import socket
import threading
import time
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pegainfer import multinode
from pegainfer.config import EngineConfig
from pegainfer.process import PARENT_PID_ENV
from pegainfer.protocol import StepPlan

logger = logging.getLogger(__name__)

RENDEZVOUS_TIMEOUT_S = 600.0
# After SIGTERM, how long the main thread gets to exit through its own handler before the
# watcher thread exits for it (the main thread may be blocked inside a collective).
SIGTERM_GRACE_S = 0.5


class StepOrderError(RuntimeError):
    """The ranks disagree on which step they run: a plan was lost, duplicated or reordered."""


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1
    host_group: object | None = None  # gloo group for host-side checks (None: the world)
    store_listener: socket.socket | None = None  # kept open: the TCP store serves on it
    wakeup_sockets: tuple[socket.socket, socket.socket] | None = None  # see below


_state = _TPState()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.size


def init_distributed(config: EngineConfig, rank: int, device: torch.device | None = None) -> None:
    """Join the tensor-parallel group as ``rank`` of ``config.tensor_parallel_size``."""
    size = config.tensor_parallel_size
    if not 0 <= rank < max(size, 1):
        raise ValueError(f"rank {rank} is outside tensor parallel size {size}")
    _state.rank, _state.size = rank, max(size, 1)
    if _state.size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    if backend == "gloo":
        _share_cpu_cores(len(multinode.local_ranks(config)))
    interface = multinode.collective_interface(config)
    if interface:
        # An explicit --dist-interface wins over the environment; a derived one does not.
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if config.dist_interface:
                os.environ[var] = interface
            else:
                os.environ.setdefault(var, interface)
    _exit_promptly_on_sigterm(config.run_dir)
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    dist.init_process_group(
        backend=backend,
        store=_make_store(config, rank, timeout),
        world_size=_state.size,
        rank=rank,
        timeout=timeout if backend == "gloo" else None,
        device_id=device if backend == "nccl" else None,
    )
    # Host-side checks must not queue behind GPU work, so on CUDA they get their own group.
    _state.host_group = dist.new_group(backend="gloo") if backend == "nccl" else None
    logger.info(
        "joined tensor parallel group: rank %d of %d (%s%s)",
        rank,
        _state.size,
        backend,
        f", interface {os.environ.get('GLOO_SOCKET_IFNAME')}" if interface else "",
    )


def _share_cpu_cores(num_local_ranks: int) -> None:
    # Ranks on the CPU each default to every core; their spinning thread pools then starve
    # one another and the gloo threads (steps ran 2-10x slower). Split the cores instead,
    # unless the user chose a thread count.
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // max(num_local_ranks, 1)))


def _make_store(config: EngineConfig, rank: int, timeout: datetime.timedelta) -> dist.Store:
    if config.nnodes <= 1:
        if not config.run_dir:
            raise ValueError("tensor parallelism needs a run directory for the rendezvous file")
        return dist.FileStore(os.path.join(config.run_dir, "tp_rendezvous"), _state.size)
    host, port = multinode.store_address(config)
    if rank != 0:
        # A client retries until rank 0's store listens (node 0 may start later).
        return dist.TCPStore(host, port, _state.size, False, timeout=timeout)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    listener = socket.create_server((host, port), family=family, backlog=128)
    _state.store_listener = listener
    return dist.TCPStore(
        host,
        port,
        _state.size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.fileno(),
        use_libuv=True,  # the only backend that serves on a socket it is given
    )


def destroy_distributed() -> None:
    if _state.size > 1 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if _state.store_listener is not None:
        _state.store_listener.close()
    _state.rank, _state.size = 0, 1
    _state.host_group, _state.store_listener = None, None


def _exit_promptly_on_sigterm(run_dir: str) -> None:
    """Exit on SIGTERM even while the main thread is blocked inside a collective.

    ``init_child``'s SIGTERM handler runs only when the main thread returns to Python, which
    a rank waiting for a dead or stuck peer never does. Python writes the number of every
    handled signal to its wakeup fd from C, in whatever thread the signal lands; a watcher
    thread reading that fd exits for the main thread if it has not within a moment.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    if not callable(signal.getsignal(signal.SIGTERM)):
        return  # default disposition: the kernel already ends the process
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:
        return
    if previous != -1:  # someone else owns the wakeup fd: leave it to them
        signal.set_wakeup_fd(previous)
        return

    def watch() -> None:
        while True:
            data = reader.recv(64)
            if signal.SIGTERM in data:
                time.sleep(SIGTERM_GRACE_S)
                parent = os.environ.get(PARENT_PID_ENV)
                if parent and os.getppid() != int(parent):
                    shutil.rmtree(run_dir, ignore_errors=True)  # no launcher left to do it
                os._exit(0)

    threading.Thread(target=watch, name="sigterm-watch", daemon=True).start()
    _state.wakeup_sockets = (reader, writer)


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------


# torch 2.13 renamed all_gather_into_tensor (and deprecated the old name).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (the partial outputs of a row-parallel layer)."""
    if _state.size == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (the vocab shards of the logits).

    One collective into one buffer ``[size * x.shape[0], ...]`` (capturable in a CUDA graph),
    then one copy into the layout concatenated along ``dim``."""
    if _state.size == 1:
        return x
    x = x.contiguous()
    gathered = torch.empty((_state.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x)
    return torch.cat(gathered.view(_state.size, *x.shape).unbind(0), dim=dim)


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place (the sampled token ids: only rank 0 samples,
    and the other ranks need its tokens as their next decode inputs)."""
    if _state.size == 1:
        return x
    dist.broadcast(x, src=0)
    return x


# ---------------------------------------------------------------------------
# Step order
# ---------------------------------------------------------------------------


def plan_digest(plan: StepPlan) -> int:
    """A 32-bit checksum of what a plan asks the ranks to compute."""
    digest = zlib.crc32(plan.seq_ids)
    digest = zlib.crc32(plan.num_computed, digest)
    digest = zlib.crc32(plan.num_scheduled, digest)
    digest = zlib.crc32(plan.finished_seq_ids, digest)
    for new in plan.new_seqs:
        digest = zlib.crc32(
            new.token_ids, zlib.crc32(new.seq_id.to_bytes(8, "little", signed=True), digest)
        )
    return digest


class StepOrderCheck:
    """Every rank runs the same step ids, in order, one after the other.

    Locally: each plan's ``step_id`` is one more than the last one's. Across ranks: one
    all-reduce (MAX) on the host of ``[id, -id, digest, -digest, local_error]`` per step,
    which yields the max and min of the step id and plan digest over the ranks; if they
    differ, or any rank saw a gap, every rank raises ``StepOrderError`` before it launches
    the step's collectives. Costs one small gloo all-reduce per step (tens of microseconds
    on one host), paid on the host while the device works through the previous step.
    """

    def __init__(self) -> None:
        self.last_step_id: int | None = None

    def check(self, plan: StepPlan) -> None:
        step_id = plan.step_id
        expected = None if self.last_step_id is None else self.last_step_id + 1
        local_error = expected is not None and step_id != expected
        if _state.size > 1:
            digest = plan_digest(plan)
            values = torch.tensor(
                [step_id, -step_id, digest, -digest, int(local_error)], dtype=torch.int64
            )
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=_state.host_group)
            high_id, low_id, high_digest, low_digest, any_error = values.tolist()
            low_id, low_digest = -low_id, -low_digest
            if any_error or high_id != low_id or high_digest != low_digest:
                raise StepOrderError(
                    f"rank {_state.rank}: the tensor-parallel ranks diverged at step {step_id} "
                    f"(step ids {low_id}..{high_id} across ranks, plan digests "
                    f"{'differ' if high_digest != low_digest else 'agree'}, "
                    f"{'a rank skipped a step' if any_error else 'no rank skipped a step'}"
                    f"{f'; this rank expected step {expected}' if local_error else ''})"
                )
        elif local_error:
            raise StepOrderError(f"step {step_id} follows step {self.last_step_id}")
        self.last_step_id = step_id
