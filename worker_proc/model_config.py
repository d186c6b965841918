"""The model's architecture hyper-parameters, read from its config.json with plain json.

Serving code never imports transformers, so this reads both the old layout (``rope_theta``
and ``rope_scaling`` at top level) and the one transformers 5 writes (``rope_parameters``),
through pegainfer/hf_config.py, which also applies the user's overrides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pegainfer.hf_config import check_rope_scaling, read_hf_config, rope_settings

_DTYPES = {"float32", "float16", "bfloat16"}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    torch_dtype: str | None  # the checkpoint's dtype, if config.json names one
    raw: dict[str, Any]  # the whole config.json, for what a model family reads itself


def parse_model_config(hf: dict[str, Any]) -> ModelConfig:
    if "text_config" in hf:  # multimodal wrappers keep the language model's settings here
        hf = {**hf, **hf["text_config"]}
    architectures = hf.get("architectures") or []
    if not architectures:
        raise ValueError("config.json names no architectures")
    num_heads = int(hf["num_attention_heads"])
    hidden_size = int(hf["hidden_size"])
    check_rope_scaling(hf)
    theta, scaling = rope_settings(hf)
    dtype = hf.get("torch_dtype") or hf.get("dtype")
    act = hf.get("hidden_act") or hf.get("hidden_activation") or "silu"
    return ModelConfig(
        architecture=architectures[0],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        hidden_act=str(act),
        torch_dtype=dtype if dtype in _DTYPES else None,
        raw=hf,
    )


def load_model_config(model_path: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    return parse_model_config(read_hf_config(model_path, overrides))
