"""Tensor parallelism over one or several hosts: where each rank runs, the TCP addresses
between nodes, the network interface collectives use, and the checks made before anything
starts. Light (no torch): the launcher and the scheduler use it too.

Node 0 runs the whole tree with ranks ``[0, L)``; node k > 0 runs only its worker
processes, ranks ``[k*L, (k+1)*L)`` with ``L = tensor_parallel_size / nnodes``, under
``pegainfer --headless --node-rank k``. Rank 0, which answers the scheduler, is always on
node 0, so results never cross hosts; step plans do.

Every TCP port is on ``--master-addr`` (an address of node 0) and bound by node 0, never on
0.0.0.0:

| port                | bound by            | carries                                     |
|---------------------|---------------------|---------------------------------------------|
| master_port         | worker-0            | torch.distributed TCP store (rendezvous)    |
| master_port + 1     | node 0's launcher   | node link: readiness, heartbeats, shutdown  |
| master_port + 2 + r | scheduler (PUSH)    | StepPlan to rank r, for ranks not on node 0 |

Nodes k > 0 only connect; gloo's and NCCL's own data sockets bind the interface from
``collective_interface``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Any

import zmq

from pegainfer import ipc
from pegainfer.config import EngineConfig
from pegainfer.hf_config import read_hf_config

_SIOCGIFADDR = 0x8915
MAX_PORT = 65535


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


def ranks_per_node(config: EngineConfig) -> int:
    return max(config.tensor_parallel_size // max(config.nnodes, 1), 1)


def node_of_rank(config: EngineConfig, rank: int) -> int:
    return rank // ranks_per_node(config)


def local_rank(config: EngineConfig, rank: int) -> int:
    """The index of ``rank`` among this node's ranks: which local GPU it takes."""
    return rank - node_of_rank(config, rank) * ranks_per_node(config)


def local_ranks(config: EngineConfig) -> list[int]:
    """The ranks whose worker processes run on this node."""
    per_node = ranks_per_node(config)
    first = config.node_rank * per_node
    return list(range(first, first + per_node))


# ---------------------------------------------------------------------------
# Addresses and sockets
# ---------------------------------------------------------------------------


def tcp_url(host: str, port: int) -> str:
    if ":" in host:  # an IPv6 literal
        return f"tcp://[{host}]:{port}"
    return f"tcp://{host}:{port}"


def store_address(config: EngineConfig) -> tuple[str, int]:
    return config.master_addr, config.master_port


def link_url(config: EngineConfig) -> str:
    return tcp_url(config.master_addr, config.master_port + 1)


def plan_url(config: EngineConfig, rank: int) -> str:
    return tcp_url(config.master_addr, config.master_port + 2 + rank)


def scheduler_plan_socket(ctx: zmq.Context, config: EngineConfig, rank: int) -> zmq.Socket:
    """The scheduler's PUSH socket to ``rank``: the rank's ipc socket on node 0, else a TCP
    port the scheduler binds on the master address (the remote rank connects to it)."""
    name = f"worker-{rank}"
    if node_of_rank(config, rank) == 0:
        return ipc.connect(ctx, zmq.PUSH, config.run_dir, name)
    return ipc.bind_url(ctx, zmq.PUSH, plan_url(config, rank), name)


def worker_plan_socket(ctx: zmq.Context, config: EngineConfig, rank: int) -> zmq.Socket:
    """The PULL socket a worker receives its plans on (see ``scheduler_plan_socket``)."""
    name = f"worker-{rank}"
    if node_of_rank(config, rank) == 0:
        return ipc.bind(ctx, zmq.PULL, config.run_dir, name)
    # Connecting before the scheduler binds is fine: ZeroMQ retries in the background.
    return ipc.connect_url(ctx, zmq.PULL, plan_url(config, rank), name)


# ---------------------------------------------------------------------------
# Network interface of the collectives
# ---------------------------------------------------------------------------


def local_address_towards(host: str) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends
    nothing; it only picks the route)."""
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def _ipv4_interfaces() -> dict[str, str]:
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # an interface without an IPv4 address
                continue
            found.setdefault(socket.inet_ntoa(reply[20:24]), name)
    return found


def _ipv6_interfaces() -> dict[str, str]:
    found = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[5]
    except OSError:
        pass
    return found


def interface_of_address(address: str) -> str | None:
    """The name of the interface holding ``address`` (any loopback address: the loopback
    interface), or None."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        ip = ipaddress.ip_address("127.0.0.1" if ip.version == 4 else "::1")
    table = _ipv4_interfaces() if ip.version == 4 else _ipv6_interfaces()
    return table.get(str(ip))


def collective_interface(config: EngineConfig) -> str | None:
    """The interface gloo and NCCL bind: ``--dist-interface`` if given; across nodes, the one
    that routes to the master address; on one node, loopback (no port on a real network)."""
    if config.dist_interface:
        return config.dist_interface
    try:
        if config.nnodes > 1:
            return interface_of_address(local_address_towards(config.master_addr))
        return interface_of_address("127.0.0.1")
    except (OSError, ValueError):
        return None  # let gloo and NCCL choose


# ---------------------------------------------------------------------------
# Checks before anything starts
# ---------------------------------------------------------------------------


def _sizes_that_divide(*counts: int) -> list[int]:
    limit = min(counts)
    return [n for n in range(1, limit + 1) if all(c % n == 0 for c in counts)]


def check_tensor_parallel(
    model_path: str, tp_size: int, overrides: dict[str, Any] | None = None
) -> None:
    """Raise ValueError, with the sizes that would work, if ``tp_size`` cannot shard the
    model: attention heads and the MLP split evenly; kv heads split evenly or, with more
    ranks than kv heads, are replicated on an equal number of ranks each."""
    if tp_size == 1:
        return
    hf = read_hf_config(model_path, overrides)
    heads = int(hf["num_attention_heads"])
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    intermediate = int(hf.get("intermediate_size") or heads)
    # A mixture of experts splits each expert's intermediate features too.
    expert_intermediate = int(hf.get("moe_intermediate_size") or intermediate)
    problems = []
    if heads % tp_size:
        problems.append(f"the {heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"the {kv_heads} kv heads (nor is it a multiple of them)")
    if intermediate % tp_size:
        problems.append(f"the MLP's {intermediate} intermediate features")
    if expert_intermediate % tp_size:
        problems.append(f"each expert's {expert_intermediate} intermediate features")
    if problems:
        usable = [
            n
            for n in _sizes_that_divide(heads, intermediate, expert_intermediate)
            if n % kv_heads == 0 or kv_heads % n == 0
        ]
        raise ValueError(
            f"--tensor-parallel-size {tp_size} does not divide {' or '.join(problems)} of "
            f"{model_path}; sizes that work for this model: "
            f"{', '.join(str(n) for n in usable)}"
        )


def check_layout(config: EngineConfig) -> None:
    """Raise ValueError on an inconsistent set of node options."""
    tp, nnodes, node = config.tensor_parallel_size, config.nnodes, config.node_rank
    if nnodes < 1:
        raise ValueError("--nnodes must be at least 1")
    if tp % nnodes:
        raise ValueError(
            f"--tensor-parallel-size {tp} does not split evenly over --nnodes {nnodes}"
        )
    if not 0 <= node < nnodes:
        raise ValueError(f"--node-rank {node} is outside [0, {nnodes})")
    if config.headless and node == 0:
        raise ValueError("--headless is for nodes other than 0 (--node-rank 1 and up)")
    if node > 0 and not config.headless:
        raise ValueError(
            f"node {node} runs only workers: start it with --headless (node 0 runs the server)"
        )
    if nnodes > 1:
        if not config.master_addr:
            raise ValueError("several nodes need --master-addr (an address of node 0)")
        last_port = config.master_port + 2 + tp - 1
        if not 0 < config.master_port or last_port > MAX_PORT:
            raise ValueError(
                f"--master-port {config.master_port}: ports up to {last_port} must be valid"
            )
