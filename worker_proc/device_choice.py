"""Which device and dtype a worker rank runs on, from the engine's settings."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_device(device: str, rank: int = 0) -> torch.device:
    """This rank's device. "auto": cuda:{rank} when CUDA is there, else cpu; "cuda":
    cuda:{rank}; "cuda:N": cuda:{N + rank} (the ranks take consecutive GPUs from N)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} was asked for, but CUDA is not available")
        first = int(device.split(":", 1)[1]) if ":" in device else 0
        return torch.device("cuda", first + rank)
    raise ValueError(f"unknown device {device!r} (auto, cpu, cuda or cuda:N)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    resolved = _DTYPES.get(dtype)
    if resolved is None:
        raise ValueError(f"unknown dtype {dtype!r} (auto, float32, bfloat16 or float16)")
    return resolved
