"""Linear layers that own their tensor-parallel sharding.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``: the model's
``load_weights`` hands it the checkpoint tensor, and the layer copies in the slice that
belongs to this rank (and, for fused layers, to the right place in the fused weight). From
the loader that tensor is a ``WeightSlice`` not yet read: ``narrow`` reads only this rank's
range from the file. A plain tensor works the same.

- ColumnParallelLinear: output features split across ranks; no communication.
- MergedColumnParallelLinear: several column-parallel outputs fused (gate/up).
- QKVParallelLinear: q, k and v projections fused; heads split across ranks.
- RowParallelLinear: input features split; partial outputs summed with an all-reduce.
- ReplicatedLinear: the whole weight on every rank (a mixture-of-experts router).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

import kernels
from worker_proc.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from worker_proc.weight_slice import WeightSlice, read_whole

if TYPE_CHECKING:
    from worker_proc.layers.norm import RMSNorm


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} does not split evenly over {denominator} ranks")
    return numerator // denominator


def _check_shape(param: nn.Parameter, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: checkpoint shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
        )


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor | WeightSlice, shard_id: object = None
) -> None:
    """Copy a replicated (unsharded) parameter, converting dtype and device on the way."""
    _check_shape(param, loaded_weight, "replicated parameter")
    param.data.copy_(read_whole(loaded_weight))


def _new_param(*shape: int) -> nn.Parameter:
    # Created in the ambient default dtype and device (the runner sets both while building
    # the model), so no full-size float32 copy is ever made on the host.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        prefetch_weight: str | None = None,
    ) -> None:
        """``prefetch_weight``: as in ``RowParallelLinear``, for the one-row GEMV."""
        super().__init__()
        self.prefetch_weight = prefetch_weight
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.weight = _new_param(self.output_size_per_rank, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _new_param(self.output_size_per_rank)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        shard = param.shape[0]
        loaded = loaded_weight.narrow(0, self.tp_rank * shard, shard)
        _check_shape(param, loaded, type(self).__name__)
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor | kernels.PendingNorm) -> torch.Tensor:
        out = kernels.linear(x, self.weight, self.bias, prefetch=self.prefetch_weight)
        return tensor_model_parallel_all_gather(out) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several projections in one weight, e.g. ``[gate | up]``;
    ``shard_id`` is the index of the projection being loaded."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs a shard index, got {shard_id!r}")
        shard = divide(self.output_sizes[shard_id], self.tp_size)
        offset = sum(divide(size, self.tp_size) for size in self.output_sizes[:shard_id])
        loaded = loaded_weight.narrow(0, self.tp_rank * shard, shard)
        target = param.data.narrow(0, offset, shard)
        _check_shape(target, loaded, f"{type(self).__name__}[{shard_id}]")
        target.copy_(loaded)

    def forward_silu_and_mul(self, x: torch.Tensor | kernels.PendingNorm) -> torch.Tensor:
        """``silu(gate) * up`` of a ``[gate | up]`` layer, fused into the projection where
        the kernels can (one decode row, no bias)."""
        if len(self.output_sizes) != 2 or self.output_sizes[0] != self.output_sizes[1]:
            raise ValueError(f"silu-and-mul needs two equal outputs, got {self.output_sizes}")
        if self.bias is not None:
            return kernels.silu_and_mul(self(x))
        return kernels.linear_silu_and_mul(x, self.weight)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused ``[q | k | v]`` projection; ``shard_id`` is "q", "k" or "v".

    Query heads split evenly across ranks. With more ranks than kv heads, each kv head is
    replicated on ``tp_size // total_num_kv_heads`` consecutive ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        prefetch_weight: str | None = None,
    ) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, output_size, bias=bias, prefetch_weight=prefetch_weight)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id == "q":
            offset, size, shard_index = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, shard_index = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"QKVParallelLinear needs shard 'q', 'k' or 'v', got {shard_id!r}")
        loaded = loaded_weight.narrow(0, shard_index * size, size)
        target = param.data.narrow(0, offset, size)
        _check_shape(target, loaded, f"{type(self).__name__}[{shard_id}]")
        target.copy_(loaded)


class RowParallelLinear(nn.Module):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        prefetch_weight: str | None = None,
    ) -> None:
        """``prefetch_weight``: what the kernel producing the input leaves of the memory
        bandwidth (``kernels.linear.AFTER_IDLE`` for decode attention, ``AFTER_STREAM`` for a
        bandwidth-bound GEMV), so that the projection's kernel reads its first weight tiles
        while that one runs (``kernels.linear_add_rms_norm``)."""
        super().__init__()
        self.prefetch_weight = prefetch_weight
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_rank = divide(input_size, self.tp_size)
        self.output_size = output_size
        self.reduce_results = reduce_results
        self.weight = _new_param(output_size, self.input_size_per_rank)
        self.weight.weight_loader = self.weight_loader
        if bias:
            # Replicated: added once, after the all-reduce.
            self.bias = _new_param(output_size)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        shard = param.shape[1]
        loaded = loaded_weight.narrow(1, self.tp_rank * shard, shard)
        _check_shape(param, loaded, type(self).__name__)
        param.data.copy_(loaded)

    def forward_add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor | kernels.PendingNorm, torch.Tensor]:
        """``(norm(self(x) + residual), self(x) + residual)``. On one rank the add ends the
        projection's kernel and the norm may come back pending, for the next projection to
        apply (kernels/linear_norm.py); shards add after their all-reduce."""
        if self.tp_size > 1 or self.bias is not None:
            return norm(self(x), residual)
        return kernels.linear_add_rms_norm(
            x, self.weight, residual, norm.weight, norm.eps, self.prefetch_weight
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = kernels.linear(x, self.weight)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


class ReplicatedLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = _new_param(output_size, input_size)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor | kernels.PendingNorm) -> torch.Tensor:
        return kernels.linear(x, self.weight)
