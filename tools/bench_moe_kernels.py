"""The mixture-of-experts rows of tools/bench_kernels.py, at Qwen3-30B-A3B's shape: routing,
the router ending in it, the grouped GEMMs, and the whole sparse MLP, each timed as CUDA
graph replays."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

DTYPE = torch.bfloat16
ELEM = 2


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured in a CUDA graph, as a decode step runs it: at a few tokens the MoE
    path's half-dozen launches take longer on the host than its kernels on the GPU, and
    timing them eagerly would time Python."""
    fn()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def moe_cases(
    device: torch.device, quick: bool
) -> list[tuple[str, Callable, Callable, int, float]]:
    """Qwen3-30B-A3B's experts (128 of 2048 x 768, 8 a token): routing, the two grouped
    GEMMs with their grouping, and the whole sparse MLP, timed as graph replays. The bytes
    are the experts the tokens touch, read once."""
    from kernels import moe_route_group, moe_router_route, moe_routing
    from kernels.fused_moe import fused_moe_ref, fused_moe_triton

    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    router_weight = torch.randn(num_experts, hidden, dtype=DTYPE, device=device) * 0.02
    w13 = torch.randn(num_experts, 2 * inter, hidden, dtype=DTYPE, device=device) * 0.02
    w2 = torch.randn(num_experts, hidden, inter, dtype=DTYPE, device=device) * 0.03
    rows: list[tuple[str, Callable, Callable, int, float]] = []
    for tokens in [1, 8, 64, 2048] if quick else [1, 2, 4, 8, 16, 64, 256, 2048]:
        logits = torch.randn(tokens, num_experts, dtype=DTYPE, device=device)
        weights, experts = moe_routing.moe_route_ref(logits, top_k, True)
        x = torch.randn(tokens, hidden, dtype=DTYPE, device=device)
        touched = int(torch.unique(experts).numel())
        args = (x, w13, w2, weights, experts)
        rows.append(
            (
                f"moe route T={tokens}",
                graphed(lambda g=logits: moe_routing.moe_route_triton(g, top_k, True)),
                graphed(lambda g=logits: moe_routing.moe_route_ref(g, top_k, True)),
                logits.numel() * ELEM + tokens * top_k * 8,
                0.0,
            )
        )
        rows.append(
            (
                f"moe route + group T={tokens}",
                graphed(
                    lambda g=logits: moe_route_group.moe_route_and_group_triton(g, top_k, True, 16)
                ),
                graphed(
                    lambda g=logits: moe_route_group.moe_route_and_group_ref(g, top_k, True, 16)
                ),
                logits.numel() * ELEM + tokens * top_k * 8,
                0.0,
            )
        )
        if moe_router_route.router_fused(tokens, top_k):
            rows += router_cases(x, router_weight, top_k)
        rows.append(
            (
                f"fused_moe T={tokens} ({touched} experts)",
                graphed(lambda a=args: fused_moe_triton(*a)),
                graphed(lambda a=args: fused_moe_ref(*a)),
                touched * 3 * hidden * inter * ELEM + 2 * x.numel() * ELEM,
                2.0 * tokens * top_k * 3 * hidden * inter,
            )
        )
    return rows + sparse_mlp_cases(device, w13, w2, top_k, [1, 8] if quick else [1, 2, 4, 8, 32])


def router_cases(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int
) -> list[tuple[str, Callable, Callable, int, float]]:
    """The router's projection and the routing of a decode batch: as one kernel
    (kernels/moe_router_route.py), and as the router's GEMV then the register kernel."""
    from kernels import moe_route_group, moe_router_route
    from kernels.linear import linear

    tokens = x.shape[0]

    def fused(x=x) -> None:
        moe_router_route.router_route_and_group_triton(x, router_weight, top_k, True, 16)

    def apart(x=x) -> None:
        logits = linear(x, router_weight)
        moe_route_group.moe_route_and_group_triton(logits, top_k, True, 16)

    def ref(x=x) -> None:
        moe_router_route.router_route_and_group_ref(x, router_weight, top_k, True, 16)

    weight_bytes = router_weight.numel() * ELEM + x.numel() * ELEM
    flops = 2.0 * x.numel() * router_weight.shape[0]
    return [
        (
            f"moe router + route + group T={tokens}",
            graphed(fused),
            graphed(ref),
            weight_bytes,
            flops,
        ),
        (
            f"moe router, then route + group T={tokens}",
            graphed(apart),
            graphed(ref),
            weight_bytes,
            flops,
        ),
    ]


# Calls of the whole sparse MLP in one timed graph, each routed differently, so that each
# reads experts the one before did not leave in L2, as the layers of a decode step do.
SPARSE_MLP_CALLS = 16


def sparse_mlp_cases(
    device: torch.device, w13: torch.Tensor, w2: torch.Tensor, top_k: int, token_counts: list[int]
) -> list[tuple[str, Callable, Callable, int, float]]:
    """The whole sparse MLP as a decode step runs it (routing, grouping, both grouped GEMMs,
    the sum ending in the residual add and the norm), ``SPARSE_MLP_CALLS`` calls a graph
    replay: the times are of all the calls, the bytes the experts each call touches."""
    from kernels import moe_routing
    from kernels.fused_moe import fused_moe_ref
    from kernels.rmsnorm import fused_add_rms_norm_ref
    from kernels.sparse_mlp import moe_mlp_add_rms_norm

    num_experts, double_inter, hidden = w13.shape
    expert_bytes = 3 * hidden * (double_inter // 2) * ELEM
    norm_weight = torch.ones(hidden, dtype=DTYPE, device=device)
    rows: list[tuple[str, Callable, Callable, int, float]] = []
    for tokens in token_counts:
        calls = []
        touched = 0
        for _ in range(SPARSE_MLP_CALLS):
            logits = torch.randn(tokens, num_experts, dtype=DTYPE, device=device)
            x = torch.randn(tokens, hidden, dtype=DTYPE, device=device)
            residual = torch.randn(tokens, hidden, dtype=DTYPE, device=device)
            experts = moe_routing.moe_route_ref(logits, top_k, True)[1]
            touched += int(torch.unique(experts).numel())
            calls.append((x, logits, residual))

        def run_triton(calls=calls) -> None:
            for x, logits, residual in calls:
                moe_mlp_add_rms_norm(x, logits, w13, w2, top_k, True, residual, norm_weight, 1e-6)

        def run_ref(calls=calls) -> None:
            for x, logits, residual in calls:
                weights, experts = moe_routing.moe_route_ref(logits, top_k, True)
                out = fused_moe_ref(x, w13, w2, weights, experts)
                fused_add_rms_norm_ref(out, residual, norm_weight, 1e-6)

        rows.append(
            (
                f"moe sparse MLP x{SPARSE_MLP_CALLS} T={tokens}",
                graphed(run_triton),
                graphed(run_ref),
                touched * expert_bytes,
                2.0 * SPARSE_MLP_CALLS * tokens * top_k * expert_bytes / ELEM,
            )
        )
    return rows
