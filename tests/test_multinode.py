"""Several hosts, without starting any: rank layout, addresses, interface detection, the
checks made before start, the node link between launchers, and the command line."""

from __future__ import annotations

import dataclasses
import socket
import time

import pytest
import zmq

from pegainfer import multinode, node_link, protocol
from pegainfer.cli import build_parser, config_from_args
from pegainfer.config import EngineConfig
from tests.server_util import free_port


def _config(**overrides) -> EngineConfig:
    return EngineConfig(model_path="/m", served_model_name="m", **overrides)


def test_ranks_are_laid_out_in_node_order():
    config = _config(tensor_parallel_size=4, nnodes=2, node_rank=1, headless=True)
    assert multinode.ranks_per_node(config) == 2
    assert multinode.local_ranks(config) == [2, 3]
    assert [multinode.node_of_rank(config, r) for r in range(4)] == [0, 0, 1, 1]
    # Each node's ranks take that node's GPUs from cuda:0.
    assert [multinode.local_rank(config, r) for r in range(4)] == [0, 1, 0, 1]
    assert multinode.local_ranks(_config(tensor_parallel_size=3)) == [0, 1, 2]


def test_ports_are_on_the_master_address():
    config = _config(tensor_parallel_size=2, nnodes=2, master_addr="10.1.2.3", master_port=4000)
    assert multinode.store_address(config) == ("10.1.2.3", 4000)
    assert multinode.link_url(config) == "tcp://10.1.2.3:4001"
    assert multinode.plan_url(config, 1) == "tcp://10.1.2.3:4003"
    config.master_addr = "fd00::5"
    assert multinode.plan_url(config, 1) == "tcp://[fd00::5]:4003"


def test_loopback_interface_is_found():
    name = multinode.interface_of_address("127.0.0.1")
    assert name is not None and name in {n for _, n in socket.if_nameindex()}
    # Every loopback address lives on the loopback interface.
    assert multinode.interface_of_address("127.0.0.5") == name
    assert multinode.interface_of_address("192.0.2.77") is None  # TEST-NET: not ours
    assert multinode.local_address_towards("127.0.0.1") == "127.0.0.1"
    single = _config(tensor_parallel_size=2)
    assert multinode.collective_interface(single) == name
    two = _config(tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1")
    assert multinode.collective_interface(two) == name
    two.dist_interface = "eth7"
    assert multinode.collective_interface(two) == "eth7"  # the user's choice, unchecked


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(tensor_parallel_size=3, nnodes=2), "does not split evenly over --nnodes 2"),
        (dict(nnodes=2, tensor_parallel_size=2, node_rank=2), "outside [0, 2)"),
        (dict(nnodes=2, tensor_parallel_size=2, node_rank=1), "--headless"),
        (dict(nnodes=2, tensor_parallel_size=2, headless=True), "nodes other than 0"),
        (dict(nnodes=2, tensor_parallel_size=2, master_port=65534), "ports up to 65537"),
        (dict(nnodes=0), "--nnodes must be at least 1"),
    ],
)
def test_inconsistent_node_options_are_refused(overrides, message):
    with pytest.raises(ValueError) as err:
        multinode.check_layout(_config(**overrides))
    assert message in str(err.value)


def test_consistent_node_options_pass():
    multinode.check_layout(_config(tensor_parallel_size=4, nnodes=2))
    multinode.check_layout(_config(tensor_parallel_size=4, nnodes=2, node_rank=1, headless=True))
    multinode.check_layout(_config(tensor_parallel_size=3))


def _write_config(path, **hf) -> str:
    import json

    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def test_tensor_parallel_size_must_shard_the_model(tmp_path):
    smollm2_like = _write_config(
        tmp_path, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
    )
    multinode.check_tensor_parallel(smollm2_like, 1)
    multinode.check_tensor_parallel(smollm2_like, 3)
    with pytest.raises(ValueError) as err:
        multinode.check_tensor_parallel(smollm2_like, 2)
    text = str(err.value)
    assert "--tensor-parallel-size 2 does not divide the 9 attention heads" in text
    assert "sizes that work for this model: 1, 3" in text
    # More ranks than kv heads: replicated, as long as the ranks split evenly over them.
    qwen_like = _write_config(
        tmp_path, num_attention_heads=8, num_key_value_heads=2, intermediate_size=64
    )
    multinode.check_tensor_parallel(qwen_like, 4)
    multinode.check_tensor_parallel(qwen_like, 8)
    with pytest.raises(ValueError, match="sizes that work for this model: 1, 2, 4, 8"):
        multinode.check_tensor_parallel(qwen_like, 3)
    odd_mlp = _write_config(
        tmp_path, num_attention_heads=4, num_key_value_heads=4, intermediate_size=30
    )
    with pytest.raises(ValueError, match="the MLP's 30 intermediate features"):
        multinode.check_tensor_parallel(odd_mlp, 4)
    # Qwen3-30B-A3B's experts are 768 wide: 8 ranks split them, but not with 36 features.
    moe_like = _write_config(
        tmp_path,
        num_attention_heads=32,
        num_key_value_heads=4,
        intermediate_size=6144,
        moe_intermediate_size=36,
    )
    multinode.check_tensor_parallel(moe_like, 4)
    with pytest.raises(ValueError) as err:
        multinode.check_tensor_parallel(moe_like, 8)
    assert "each expert's 36 intermediate features" in str(err.value)
    assert "sizes that work for this model: 1, 2, 4" in str(err.value)


def test_command_line_carries_the_node_options():
    args = build_parser().parse_args(
        [
            "--tensor-parallel-size",
            "4",
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "3000",
            "--dist-interface",
            "eth1",
            "--headless",
        ]
    )
    config = config_from_args(args)
    assert (config.nnodes, config.node_rank, config.headless) == (2, 1, True)
    assert (config.master_addr, config.master_port, config.dist_interface) == (
        "10.0.0.1",
        3000,
        "eth1",
    )
    # The defaults are one node on loopback.
    default = config_from_args(build_parser().parse_args([]))
    assert (default.nnodes, default.node_rank, default.master_addr) == (1, 0, "127.0.0.1")
    assert not default.headless and default.dist_interface == ""
    # And they survive the run directory's config.json.
    assert EngineConfig.from_json(config.to_json()).master_port == 3000


# --- the node link ----------------------------------------------------------------------


def _headless(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, node_rank=1, headless=True)


def _link_config() -> EngineConfig:
    return _config(
        tensor_parallel_size=4, nnodes=2, master_addr="127.0.0.1", master_port=free_port()
    )


def _until(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_node_link_forwards_ready_and_stops_both_ways(monkeypatch):
    monkeypatch.setattr(node_link, "HEARTBEAT_S", 0.05)
    ctx = zmq.Context()
    config = _link_config()
    server = node_link.NodeLinkServer(ctx, config)
    client = node_link.NodeLinkClient(ctx, _headless(config))
    try:
        ready = protocol.ProcessReady(name="worker-2", pid=1, info={"num_kv_blocks": 7})
        client.forward(ready)
        # A rank that is not node 1's is not taken from node 1.
        client.forward(protocol.ProcessReady(name="worker-0", pid=1, info={}))
        got = _until(lambda: server.poll())
        assert [m.name for m in got] == ["worker-2"] and got[0].info["num_kv_blocks"] == 7
        assert "node-1" in server.last_seen
        # Heartbeats flow from node 0 to the node that joined.
        _until(lambda: (server.poll(), client.poll(), client.last_seen)[2] is not None)
        server.check()
        client.check()
        # A clean stop of node 0 stops node 1 cleanly.
        server.close(node_link.STOPPED)
        with pytest.raises(node_link.StopFromNode0):
            _until(lambda: client.poll() or False, timeout=2)
    finally:
        server.sock.close()
        client.close(None)
        ctx.term()


def test_node_link_reports_a_failed_or_silent_node(monkeypatch):
    ctx = zmq.Context()
    config = _link_config()
    server = node_link.NodeLinkServer(ctx, config)
    client = node_link.NodeLinkClient(ctx, _headless(config))
    stranger = ctx.socket(zmq.DEALER)
    stranger.setsockopt(zmq.IDENTITY, b"node-9")
    stranger.setsockopt(zmq.LINGER, 0)
    stranger.connect(multinode.link_url(config))
    try:
        stranger.send(protocol.encode(protocol.Shutdown(reason="not one of ours")))
        client.sock.send(b"\x93garbage")  # malformed: logged and dropped
        _until(lambda: (server.poll(), server.last_seen)[1])
        assert set(server.last_seen) == {"node-1"}
        monkeypatch.setattr(node_link, "NODE_TIMEOUT_S", 0.0)
        time.sleep(0.01)
        with pytest.raises(node_link.NodeLost, match="node-1 sent nothing"):
            server.check()
        monkeypatch.setattr(node_link, "NODE_TIMEOUT_S", 30.0)
        client.close("node 1: pegainfer::worker-2 (pid 5) was killed by signal SIGKILL")
        with pytest.raises(node_link.NodeLost, match="node-1 stopped: node 1: .*worker-2"):
            _until(lambda: server.poll() or False, timeout=2)
    finally:
        stranger.close()
        server.close("test over")
        client.sock.close()
        ctx.term()
