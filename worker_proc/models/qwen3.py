"""Qwen3 dense (Qwen3ForCausalLM): Llama with a per-head RMSNorm on q and k before rope.

attention -> MLP -> decoder layer -> model -> causal LM; the MLP and everything above the
attention are Llama's (models/llama.py), so only the attention is written here. Qwen3 has
no qkv bias (``attention_bias`` false) and small sizes tie the LM head to the embedding;
both come from config.json.
"""

from __future__ import annotations

import torch

from worker_proc.layers.norm import RMSNorm
from worker_proc.layers.rotary import RotaryEmbedding
from worker_proc.model_config import ModelConfig
from worker_proc.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, layer_idx, rotary_emb)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps


Qwen3MLP = LlamaMLP


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
