"""The whole sparse MLP of a mixture-of-experts layer: the router and routing
(kernels/moe_router_route.py, kernels/moe_route_group.py), the experts' grouped GEMMs
(kernels/fused_moe.py), and the sum over each token's experts ending in the residual add and
RMSNorm that follow (kernels/moe_sum.py).

At decode rows it takes and gives a ``PendingNorm`` (kernels/pending_norm.py), as the dense
layers' projections do: the router and the first grouped GEMM apply the input's norm as
they read it, and the output's norm is left to the next layer's qkv projection. That is two
norm kernels a layer fewer than materializing the norm before the router and normalizing
whole rows after the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.backend import load_triton, use_triton
from kernels.fused_moe import experts_per_pair, fused_moe_ref
from kernels.linear import linear
from kernels.moe_grouping import MoeGroups
from kernels.moe_route_group import moe_route_and_group_triton
from kernels.moe_router_route import router_fused, router_route_and_group_triton
from kernels.moe_routing import moe_route_ref
from kernels.moe_sum import moe_sum_add_pending_norm_triton, moe_sum_add_rms_norm_triton
from kernels.moe_tiles import moe_tiles
from kernels.pending_norm import PendingNorm, as_tensor
from kernels.rmsnorm import fused_add_rms_norm_ref


def moe_mlp(
    x: torch.Tensor | PendingNorm,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:
    """Route ``x [T, H]`` by ``router_logits [T, E]`` and run it through its experts."""
    if not use_triton(router_logits):
        weights, experts = moe_route_ref(router_logits, top_k, renormalize)
        return fused_moe_ref(as_tensor(x), w13, w2, weights, experts)
    per_pair = _routed_per_pair(x, _by_logits(router_logits, top_k, renormalize), w13, w2, top_k)
    return per_pair.sum(dim=1).to(w13.dtype)


def moe_layer_add_rms_norm(
    x: torch.Tensor | PendingNorm,
    router_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """The router's projection ``x @ router_weight.T``, then ``moe_mlp_add_rms_norm``. At
    decode rows on a GPU the router ends in the routing and grouping, one kernel."""
    num_tokens = (x.hidden if isinstance(x, PendingNorm) else x).shape[0]
    if not use_triton(router_weight) or not router_fused(num_tokens, top_k):
        router_logits = linear(x, router_weight)
        return moe_mlp_add_rms_norm(
            x, router_logits, w13, w2, top_k, renormalize, residual, norm_weight, eps
        )

    def route(block_m: int) -> tuple[torch.Tensor, MoeGroups]:
        weights, _, groups = router_route_and_group_triton(
            x, router_weight, top_k, renormalize, block_m
        )
        return weights, groups

    per_pair = _routed_per_pair(x, route, w13, w2, top_k)
    return _sum_add_norm(per_pair, residual, norm_weight, eps)


def moe_mlp_add_rms_norm(
    x: torch.Tensor | PendingNorm,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    """``moe_mlp`` then ``fused_add_rms_norm``; on a GPU the experts' sum ends in the add
    and the norm, one kernel, and at decode rows the norm is left pending (see above)."""
    if not use_triton(router_logits):
        out = moe_mlp(x, router_logits, w13, w2, top_k, renormalize)
        return fused_add_rms_norm_ref(out, residual, norm_weight, eps)
    per_pair = _routed_per_pair(x, _by_logits(router_logits, top_k, renormalize), w13, w2, top_k)
    return _sum_add_norm(per_pair, residual, norm_weight, eps)


def _sum_add_norm(
    per_pair: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor | PendingNorm, torch.Tensor]:
    if _leaves_norm_pending(per_pair.shape[0], residual):
        normed = moe_sum_add_pending_norm_triton(per_pair, residual, norm_weight, eps)
        return normed, normed.hidden
    return moe_sum_add_rms_norm_triton(per_pair, residual, norm_weight, eps)


def _leaves_norm_pending(num_tokens: int, residual: torch.Tensor) -> bool:
    """The rows and dtypes whose next projection applies a pending norm itself, as after the
    dense layers' o and down projections (kernels/linear_norm.py)."""
    from kernels.linear_norm import fused_rows_limit

    return 0 < num_tokens <= fused_rows_limit() and residual.dtype in (
        torch.bfloat16,
        torch.float16,
    )


# Routes a step's tokens for grouped GEMMs of ``block_m`` rows a block: (the pairs' weights
# [T, top_k], their layout).
Router = Callable[[int], tuple[torch.Tensor, MoeGroups]]


def _by_logits(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Router:
    def route(block_m: int) -> tuple[torch.Tensor, MoeGroups]:
        weights, _, groups = moe_route_and_group_triton(router_logits, top_k, renormalize, block_m)
        return weights, groups

    return route


def _routed_per_pair(
    x: torch.Tensor | PendingNorm,
    route: Router,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    num_experts = w13.shape[0]
    if top_k > num_experts:
        raise ValueError(f"top_k {top_k} exceeds the {num_experts} experts")
    normed = x if isinstance(x, PendingNorm) else None
    if normed is not None:
        x = normed.weighted
    if x.shape[0] == 0:
        return torch.zeros((0, top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    tiles = moe_tiles(x.shape[0], x.element_size())
    load_triton()
    weights, groups = route(tiles[0])
    return experts_per_pair(x, w13, w2, weights, groups, tiles, normed)
