"""The experts of a mixture-of-experts MLP, with their tensor-parallel sharding.

Every rank holds every expert, each cut along its intermediate features (as a dense MLP is
split: gate/up by output rows, down by input columns), so the ranks' partial outputs are
summed by one all-reduce and the routing needs no exchange of tokens. The checkpoint's
per-expert projections land in two stacked parameters: ``w13 [E, 2I/tp, H]`` (each expert's
gate rows, then its up rows) and ``w2 [E, H, I/tp]``. Their ``weight_loader`` takes the
shard ``(expert, "gate" | "up" | "down")``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from worker_proc.layers.linear import _check_shape, _new_param, divide
from worker_proc.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

if TYPE_CHECKING:
    from worker_proc.layers.norm import RMSNorm

PROJECTIONS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{top_k} experts a token out of {num_experts}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.intermediate_per_rank = divide(intermediate_size, self.tp_size)
        self.w13 = _new_param(num_experts, 2 * self.intermediate_per_rank, hidden_size)
        self.w2 = _new_param(num_experts, hidden_size, self.intermediate_per_rank)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def all_shards(self, param: nn.Parameter) -> set[tuple[int, str]]:
        """The shards that load ``param`` completely."""
        names = ("gate", "up") if param is self.w13 else ("down",)
        return {(expert, name) for expert in range(self.num_experts) for name in names}

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if (
            not isinstance(shard_id, tuple)
            or len(shard_id) != 2
            or not isinstance(shard_id[0], int)
            or not 0 <= shard_id[0] < self.num_experts
            or shard_id[1] not in PROJECTIONS
        ):
            raise ValueError(f"FusedMoE needs a shard (expert, gate|up|down), got {shard_id!r}")
        expert, projection = shard_id
        size = self.intermediate_per_rank
        start = self.tp_rank * size
        if projection == "down":
            loaded = loaded_weight.narrow(1, start, size)
            target = param.data[expert]
        else:
            loaded = loaded_weight.narrow(0, start, size)
            target = param.data[expert].narrow(0, 0 if projection == "gate" else size, size)
        _check_shape(target, loaded, f"expert {expert} {projection}_proj")
        target.copy_(loaded)

    def forward(
        self, x: torch.Tensor | kernels.PendingNorm, router_logits: torch.Tensor
    ) -> torch.Tensor:
        """``x [T, H]`` routed by ``router_logits [T, E]`` -> ``[T, H]``, summed over ranks."""
        out = kernels.moe_mlp(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)
        return tensor_model_parallel_all_reduce(out)

    def forward_add_norm(
        self,
        x: torch.Tensor | kernels.PendingNorm,
        router_weight: torch.Tensor,
        residual: torch.Tensor,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor | kernels.PendingNorm, torch.Tensor]:
        """``(norm(self(x) + residual), self(x) + residual)``, routed by the router's
        projection ``x @ router_weight.T``. On one rank the experts' sum ends in the add and
        the norm, which at decode rows is left pending, and there the router's projection
        ends in the routing; shards add after their all-reduce."""
        if self.tp_size > 1:
            return norm(self(x, kernels.linear(x, router_weight)), residual)
        return kernels.moe_layer_add_rms_norm(
            x,
            router_weight,
            self.w13,
            self.w2,
            self.top_k,
            self.renormalize,
            residual,
            norm.weight,
            norm.eps,
        )
