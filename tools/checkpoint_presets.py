"""The model shapes ``tools/make_tiny_checkpoint.py`` writes: per architecture, the
``config.json`` fields of each preset (the tiny test models and the published Qwen3 sizes).
"""

from __future__ import annotations

from typing import Any

# Qwen3's vocabulary rows: 151643 BPE tokens + the added tokens, padded up as Qwen ships it.
QWEN3_VOCAB = 151936
QWEN_ENDOFTEXT = 151643
QWEN_IM_END = 151645

_COMMON: dict[str, Any] = {"vocab_size": QWEN3_VOCAB, "hidden_act": "silu"}
_QWEN3_BASE: dict[str, Any] = {
    **_COMMON,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "head_dim": 128,
}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3": {
        "tiny": {
            **_QWEN3_BASE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
        "micro": {
            **_QWEN3_BASE,
            "vocab_size": 4096,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": True,
        },
        "0.6b": {
            **_QWEN3_BASE,
            "hidden_size": 1024,
            "intermediate_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
        },
        "1.7b": {
            **_QWEN3_BASE,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
        },
        "4b": {
            **_QWEN3_BASE,
            "hidden_size": 2560,
            "intermediate_size": 9728,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": True,
        },
        "8b": {
            **_QWEN3_BASE,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
        # 40 query heads over 8 KV heads: groups of five.
        "14b": {
            **_QWEN3_BASE,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
        "32b": {
            **_QWEN3_BASE,
            "hidden_size": 5120,
            "intermediate_size": 25600,
            "num_hidden_layers": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
    },
    # Qwen3-30B-A3B's layout: 128 experts of 768 features, 8 a token, renormalised.
    "qwen3_moe": {
        # The middle layer dense (mlp_only_layers), so both kinds of MLP are tested.
        "tiny": {
            **_QWEN3_BASE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        "30b-a3b": {
            **_QWEN3_BASE,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
        },
    },
    "llama": {
        # Untied, unlike tiny qwen3 and SmolLM2, so the separate lm_head path gets tested too.
        "tiny": {
            **_COMMON,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 4096,
            "rope_theta": 100_000.0,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
    },
}
ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
}
