"""What a model step must move and compute, from the checkpoint's config.json, and the floors
(rooflines) those bytes and FLOPs give at the rates measured in the run.

A decode step reads every weight once (a tied embedding in full, as the LM head; an untied
one only row by row) plus the KV cache of every context it attends to; its floor is those
bytes over the copy bandwidth (or its FLOPs over the matmul rate, if larger). A prefill is
bound by the larger of its FLOPs over the matmul rate and its bytes over the bandwidth.

In a mixture of experts a step reads only the experts its tokens are routed to: with
``k`` of ``E`` experts a token, ``n`` tokens touch ``E * (1 - (1 - k / E) ** n)`` of them a
layer on average when routing is uniform (as it is for random weights), and each token
computes with ``k`` experts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Roofline:
    """The two rates measured in this run, and the floors they give for a step."""

    device: str
    dtype: str
    copy_bytes_per_s: float  # bytes read + written per second
    matmul_flops_per_s: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.matmul_flops_per_s, nbytes / self.copy_bytes_per_s)

    def describe(self) -> str:
        return (
            f"roofline measured on {self.device} ({self.dtype}): copy "
            f"{self.copy_bytes_per_s / 1e9:.1f} GB/s (read + written), matmul "
            f"{self.matmul_flops_per_s / 1e12:.2f} TFLOP/s"
        )


@dataclass
class ModelShape:
    """The sizes that set a decoder-only transformer's bytes and FLOPs, from config.json."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    has_qk_norm: bool
    dtype_bytes: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_sparse_layers: int = 0

    @property
    def attention_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one dense layer's projections (QKV, O, gate/up, down)."""
        return self.attention_params + 3 * self.hidden_size * self.intermediate_size

    def _matmul_params(self, experts_a_layer: float) -> float:
        """All layers' projection weights with ``experts_a_layer`` experts (and the router)
        in each sparse layer."""
        dense_layers = self.num_layers - self.num_sparse_layers
        dense_mlp = 3 * self.hidden_size * self.intermediate_size
        sparse_mlp = experts_a_layer * self.expert_params + self.hidden_size * self.num_experts
        return (
            self.num_layers * self.attention_params
            + dense_layers * dense_mlp
            + self.num_sparse_layers * sparse_mlp
        )

    @property
    def matmul_params_per_token(self) -> float:
        """Projection weights one token computes with (its ``k`` experts in sparse layers)."""
        return self._matmul_params(self.experts_per_token)

    def experts_touched(self, num_tokens: int) -> float:
        """Experts a sparse layer reads for ``num_tokens`` tokens, uniform routing."""
        if not self.num_experts:
            return 0.0
        left_out = (1.0 - self.experts_per_token / self.num_experts) ** num_tokens
        return self.num_experts * (1.0 - left_out)

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        norms = self.num_layers * (
            2 * self.hidden_size + (2 * self.head_dim if self.has_qk_norm else 0)
        )
        embed = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        matmuls = round(self._matmul_params(self.num_experts))
        return matmuls + norms + self.hidden_size + embed

    def step_weight_bytes(self, num_tokens: int) -> float:
        """Weight bytes a step of ``num_tokens`` tokens reads: all of them but the experts no
        token is routed to, and an untied embedding table, only gathered row by row (a tied
        one is read in full as the LM head)."""
        params = self.num_params - self.num_sparse_layers * self.expert_params * (
            self.num_experts - self.experts_touched(num_tokens)
        )
        if not self.tie_word_embeddings:
            params -= self.lm_head_params
        return params * self.dtype_bytes

    @property
    def decode_weight_bytes(self) -> float:
        """Weight bytes a batch-1 decode step reads."""
        return self.step_weight_bytes(1)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def decode_step_bytes(self, context_lens: Sequence[int]) -> int:
        """Weights once, plus the KV cache of every context attended (the new tokens' KV
        written is one token per sequence, counted too)."""
        kv_tokens = sum(context_lens) + len(context_lens)
        return self.step_weight_bytes(len(context_lens)) + kv_tokens * self.kv_bytes_per_token

    def attention_flops(self, query_len: int, context_len: int) -> float:
        """QK^T and PV for ``query_len`` new tokens at the end of ``context_len`` tokens,
        counting only the unmasked (causal) pairs."""
        first = context_len - query_len + 1
        pairs = query_len * (first + context_len) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs

    def step_flops(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """A step where sequence i runs query_lens[i] tokens ending at context_lens[i]; the
        LM head runs once per sequence (only the last token samples)."""
        tokens = sum(query_lens)
        flops = 2.0 * self.matmul_params_per_token * tokens
        flops += 2.0 * self.lm_head_params * len(query_lens)
        for q, c in zip(query_lens, context_lens):
            flops += self.attention_flops(q, c)
        return flops

    def prefill_bytes(self, prompt_lens: Sequence[int]) -> int:
        """Weights once, the KV written, and activations in and out of each projection."""
        tokens = sum(prompt_lens)
        activations = (
            2
            * tokens
            * self.num_layers
            * (2 * self.hidden_size + self.intermediate_size)
            * self.dtype_bytes
        )
        weights = self.step_weight_bytes(tokens)
        return weights + tokens * self.kv_bytes_per_token + activations


def load_model_shape(model_path: str, dtype_bytes: int | None = None) -> ModelShape:
    with open(os.path.join(model_path, "config.json")) as f:
        hf = json.load(f)
    if "text_config" in hf:
        hf = {**hf, **hf["text_config"]}
    if dtype_bytes is None:
        dtype_bytes = _DTYPE_BYTES.get(hf.get("torch_dtype") or hf.get("dtype") or "", 2)
    num_heads = hf["num_attention_heads"]
    architecture = (hf.get("architectures") or ["?"])[0]
    num_layers = hf["num_hidden_layers"]
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or [])
    sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    return ModelShape(
        architecture=architecture,
        num_layers=num_layers,
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        has_qk_norm=architecture.startswith("Qwen3"),
        dtype_bytes=dtype_bytes,
        num_experts=num_experts,
        experts_per_token=int(hf.get("num_experts_per_tok") or 0) if num_experts else 0,
        expert_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
        num_sparse_layers=len(sparse) if num_experts else 0,
    )


def decode_roofline_s(shape: ModelShape, roof: Roofline, context_lens: Sequence[int]) -> float:
    """Floor of one decode step of these contexts (each sequence adds one token)."""
    flops = shape.step_flops([1] * len(context_lens), [c + 1 for c in context_lens])
    return roof.seconds(flops, shape.decode_step_bytes(context_lens))


def prefill_roofline_s(shape: ModelShape, roof: Roofline, prompt_lens: Sequence[int]) -> float:
    flops = shape.step_flops(list(prompt_lens), list(prompt_lens))
    return roof.seconds(flops, shape.prefill_bytes(prompt_lens))


def generation_roofline_s(
    shape: ModelShape, roof: Roofline, batch: int, input_len: int, output_len: int
) -> float:
    """Floor of a whole offline run: prefill every prompt, then ``output_len - 1`` decode
    steps of the full batch (the first token comes from the prefill)."""
    total = prefill_roofline_s(shape, roof, [input_len] * batch)
    for step in range(1, output_len):
        total += decode_roofline_s(shape, roof, [input_len + step - 1] * batch)
    return total
