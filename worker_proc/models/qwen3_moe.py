"""Qwen3 mixture of experts (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-30B-A3B): Qwen3's attention, and in most layers a sparse MLP of many small
experts of which each token takes ``num_experts_per_tok``.

sparse MLP -> decoder layer -> model -> causal LM. The attention is Qwen3's
(models/qwen3.py). A layer is sparse unless ``mlp_only_layers`` names it or
``decoder_sparse_step`` skips it; those layers keep a dense MLP of ``intermediate_size``.
The router is a replicated linear layer; its softmax, top-k and (``norm_topk_prob``)
renormalisation, and the experts themselves, are kernels/moe_routing.py,
kernels/moe_route_group.py and kernels/fused_moe.py. The checkpoint's
``mlp.experts.{e}.{gate,up,down}_proj`` tensors load into the stacked expert weights of
worker_proc/layers/fused_moe.py.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from worker_proc.layers.fused_moe import FusedMoE
from worker_proc.layers.linear import ReplicatedLinear
from worker_proc.layers.norm import RMSNorm
from worker_proc.model_config import ModelConfig
from worker_proc.models.llama import Activation, LlamaForCausalLM, LlamaMLP, LlamaModel
from worker_proc.models.qwen3 import Qwen3DecoderLayer

_EXPERT_TENSOR = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def num_experts(config: ModelConfig) -> int:
    # Checkpoints name it num_experts; transformers 5 writes num_local_experts.
    return int(config.raw.get("num_experts") or config.raw.get("num_local_experts") or 0)


def is_sparse_layer(config: ModelConfig, layer_idx: int) -> bool:
    step = int(config.raw.get("decoder_sparse_step", 1) or 1)
    dense = set(config.raw.get("mlp_only_layers") or [])
    return layer_idx not in dense and num_experts(config) > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        raw = config.raw
        self.gate = ReplicatedLinear(config.hidden_size, num_experts(config))
        self.experts = FusedMoE(
            num_experts=num_experts(config),
            top_k=int(raw["num_experts_per_tok"]),
            hidden_size=config.hidden_size,
            intermediate_size=int(raw["moe_intermediate_size"]),
            renormalize=bool(raw.get("norm_topk_prob", False)),
        )

    def forward(
        self, x: Activation, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[Activation, torch.Tensor]:
        """``(norm(moe + residual), moe + residual)``; the norm may be left pending."""
        # A pending norm (kernels/pending_norm.py) is applied by the router's projection and
        # by the experts' first GEMM as each reads it.
        return self.experts.forward_add_norm(x, self.gate.weight, residual, norm)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config)


class Qwen3MoeModel(LlamaModel):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        expert = _EXPERT_TENSOR.match(name)
        if expert is None:
            return super().checkpoint_target(name)
        prefix, index, projection = expert.groups()
        param = "w2" if projection == "down" else "w13"
        return f"{prefix}.{param}", (int(index), projection)

    def expected_shards(self, name: str) -> set:
        if name.endswith((".experts.w13", ".experts.w2")):
            experts = self.get_submodule(name.rsplit(".", 1)[0])
            return experts.all_shards(self.get_parameter(name))
        return super().expected_shards(name)
