"""tools/bench_moe_kernels.py (tools/bench_kernels.py's MoE rows), built and run once on the
CPU, the graphs replaced by the calls they capture: every row's functions run, and the bytes
are the experts touched."""

from __future__ import annotations

import torch
from triton_test_util import DEVICE, requires_triton

from tools import bench_moe_kernels as bench_kernels


def test_sparse_mlp_rows_run_and_count_the_experts_touched(monkeypatch):
    monkeypatch.setattr(bench_kernels, "graphed", lambda fn: fn)
    monkeypatch.setattr(bench_kernels, "DTYPE", torch.float32)
    monkeypatch.setattr(bench_kernels, "SPARSE_MLP_CALLS", 3)
    hidden, inter, num_experts, top_k = 16, 8, 6, 2
    w13 = torch.randn(num_experts, 2 * inter, hidden)
    w2 = torch.randn(num_experts, hidden, inter)
    rows = bench_kernels.sparse_mlp_cases(torch.device("cpu"), w13, w2, top_k, [1, 5])
    assert [row[0] for row in rows] == ["moe sparse MLP x3 T=1", "moe sparse MLP x3 T=5"]
    expert_bytes = 3 * hidden * inter * bench_kernels.ELEM
    for name, run_triton, run_ref, moved, flops in rows:
        run_triton()
        run_ref()
        tokens = int(name.rsplit("=", 1)[1])
        assert moved % expert_bytes == 0
        # Each call touches between top_k and min(tokens * top_k, num_experts) experts.
        assert 3 * top_k <= moved // expert_bytes <= 3 * min(tokens * top_k, num_experts)
        assert flops == 2.0 * 3 * tokens * top_k * expert_bytes / bench_kernels.ELEM


@requires_triton
def test_router_rows_run_both_ways(monkeypatch):
    monkeypatch.setattr(bench_kernels, "graphed", lambda fn: fn)
    x = torch.randn(2, 32, device=DEVICE)
    router_weight = torch.randn(8, 32, device=DEVICE)
    rows = bench_kernels.router_cases(x, router_weight, 2)
    assert [row[0] for row in rows] == [
        "moe router + route + group T=2",
        "moe router, then route + group T=2",
    ]
    for _, run_triton, run_ref, moved, flops in rows:
        run_triton()
        run_ref()
        assert moved == (8 * 32 + 2 * 32) * bench_kernels.ELEM
        assert flops == 2.0 * 2 * 32 * 8
