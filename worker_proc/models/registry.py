"""Model classes by config.json ``architectures`` name."""

from __future__ import annotations

from torch import nn

from worker_proc.model_config import ModelConfig
from worker_proc.models.llama import LlamaForCausalLM
from worker_proc.models.qwen3 import Qwen3ForCausalLM
from worker_proc.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    cls = MODEL_REGISTRY.get(architecture)
    if cls is None:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(f"architecture {architecture!r} is not supported (supported: {supported})")
    return cls


def build_model(config: ModelConfig) -> nn.Module:
    return get_model_class(config.architecture)(config)
