"""Llama (LlamaForCausalLM): attention -> MLP -> decoder layer -> model -> causal LM.

Each rank holds its tensor-parallel shard of every layer; the sharding lives in the layers
(worker_proc/layers), so this file reads like the single-GPU model. The flat batch of the
step comes in as ``input_ids [T]`` and ``positions [T]``; attention metadata comes from the
forward context.

Qwen3 (models/qwen3.py) differs only in its attention and reuses the rest by subclassing:
``LlamaDecoderLayer.attention_cls``, ``LlamaModel.layer_cls`` and
``LlamaForCausalLM.model_cls`` are the seams.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

import kernels
from kernels.linear import AFTER_IDLE, AFTER_STREAM
from worker_proc.layers.attention import Attention
from worker_proc.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker_proc.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from worker_proc.layers.norm import RMSNorm
from worker_proc.layers.rotary import RotaryEmbedding
from worker_proc.model_config import ModelConfig

# A layer's normed input: a tensor, or the norm pending in the projection that reads it.
Activation = torch.Tensor | kernels.PendingNorm


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
            # Its input comes from the down projection (or the embedding), which streams its
            # weight to its end: qkv reads its first weight tiles meanwhile.
            prefetch_weight=AFTER_STREAM,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        # Decode attention leaves the memory bandwidth mostly idle: o reads its first weight
        # tiles meanwhile.
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.attention_bias,
            prefetch_weight=AFTER_IDLE,
        )
        self.rotary_emb = rotary_emb  # one cos/sin cache shared by every layer
        self.attn = Attention(
            self.num_heads, config.head_dim, config.head_dim**-0.5, self.num_kv_heads, layer_idx
        )

    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Llama has no q/k normalization; families with a per-head RMSNorm of q and k
        before rope return ``(q weight, k weight, eps)``."""
        return None

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: Activation,
        residual: torch.Tensor,
        norm: RMSNorm,
    ) -> tuple[Activation, torch.Tensor]:
        """``(norm(attention + residual), attention + residual)``."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # Rotary embedding (and any q/k norm) is applied inside the attention layer, fused
        # with the KV write.
        out = self.attn(q, k, v, positions, self.rotary_emb, self.qk_norm())
        return self.o_proj.forward_add_norm(out, residual, norm)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"activation {config.hidden_act!r} is not supported")
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=config.mlp_bias
        )
        # Its input comes from the gate/up GEMV, which streams its weight to its end: down
        # reads a first weight tile to fill the gap between the two.
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.mlp_bias,
            prefetch_weight=AFTER_STREAM,
        )

    def forward(
        self, x: Activation, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[Activation, torch.Tensor]:
        """``(norm(mlp + residual), mlp + residual)``."""
        # At decode rows the activation is the gate/up projection's epilogue: one kernel less.
        activation = self.gate_up_proj.forward_silu_and_mul(x)
        return self.down_proj.forward_add_norm(activation, residual, norm)


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, rotary_emb)
        self.mlp = self.build_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def build_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        """The layer's MLP: ``mlp(x, residual, norm) -> (norm(mlp(x) + residual), sum)``."""
        return LlamaMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: Activation,
        residual: torch.Tensor,
        next_norm: RMSNorm,
    ) -> tuple[Activation, torch.Tensor]:
        """``hidden_states`` is this layer's normed input (its ``input_layernorm`` of the
        ``residual`` stream); returns ``next_norm`` of the stream after the layer, and that
        stream. The residual add of each sublayer ends its output projection, and the norm
        after it may be left for the next projection to apply (kernels/pending_norm.py)."""
        hidden_states, residual = self.self_attn(
            positions, hidden_states, residual, self.post_attention_layernorm
        )
        return self.mlp(hidden_states, residual, next_norm)


class LlamaModel(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Built once: at 40k positions a per-layer cos/sin cache would cost ~20 MB a layer.
        rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, rotary_emb) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        first_norm = self.layers[0].input_layernorm
        hidden_states: Activation
        hidden_states, residual = self.embed_tokens.embed_and_norm(
            input_ids, first_norm.weight, first_norm.eps
        )
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, next_norms, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, next_norm)
        # The LM head takes only the rows the runner samples, so the final norm is applied.
        return kernels.as_tensor(hidden_states)

    @contextmanager
    def representative_layers(self) -> Iterator[None]:
        """Inside the block the forward runs only the first, second and last layers. Every
        layer launches the same kernels on tensors of the same shapes; only the first (which
        norms the embedding itself) and the last (which leaves the final norm pending) differ
        in the norms around them. The start-up's compile pass runs its forwards so: it needs
        each kernel variant once, not once a layer (worker_proc/graph_capture.py)."""
        layers = self.layers
        if len(layers) > 3:
            self.layers = nn.ModuleList([layers[0], layers[1], layers[-1]])
        try:
            yield
        finally:
            self.layers = layers


# Checkpoint projections that land in one fused parameter: (fused, checkpoint name, shard).
_STACKED_PARAMS: list[tuple[str, str, str | int]] = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]
# Buffers some checkpoints carry that this implementation recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaForCausalLM(nn.Module):
    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids, positions [T] -> hidden states [T, hidden_size]``."""
        return self.model(input_ids, positions)

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[N, hidden_size] -> [N, vocab_size]`` in the model dtype (into ``out``, if given)."""
        return self.lm_head.compute_logits(hidden_states, out)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        """The parameter a checkpoint tensor loads into, and its shard of it."""
        for fused, original, shard_id in _STACKED_PARAMS:
            if f".{original}." in name:
                return name.replace(f".{original}.", f".{fused}."), shard_id
        return name, None

    def expected_shards(self, name: str) -> set:
        """The shards that load the parameter ``name`` completely."""
        shards = {shard for fused, _, shard in _STACKED_PARAMS if f".{fused}." in name}
        return shards or {None}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named checkpoint tensors, fusing q/k/v and gate/up on the way.

        Raises on a tensor with no home and on a parameter left unloaded, so a naming
        mismatch fails at start instead of serving noise.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, set] = {name: set() for name in params}
        unexpected = []
        for name, tensor in weights:
            if name.endswith(_SKIPPED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the embedding is loaded under its own name
            target, shard = self.checkpoint_target(name)
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard)
            loaded[target].add(shard)
        if unexpected:
            raise ValueError(f"checkpoint tensors with no parameter: {sorted(unexpected)[:8]}")
        missing = [name for name in params if loaded[name] != self.expected_shards(name)]
        if missing:
            raise ValueError(f"parameters not (fully) loaded from the checkpoint: {missing[:8]}")
