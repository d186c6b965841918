"""Tensor memory accelerator (TMA, Hopper and later) descriptors of weights.

A Triton kernel given a host-side ``TensorDescriptor`` reads its tiles with one bulk copy
each into shared memory, where pointer loads take one address per element and registers to
hold them. The descriptor describes the weight's base, shape and row stride, so it stays
valid for as long as the weight does, and a CUDA graph captures it with the launch.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def tma_fits(weight: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can read ``weight``: 16-byte aligned rows, on a
    GPU of compute capability 9.0 or later (or in Triton's interpreter, which emulates it)."""
    row_bytes = weight.stride(0) * weight.element_size()
    if weight.data_ptr() % 16 or row_bytes % 16:
        return False
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return True
    return weight.is_cuda and torch.cuda.get_device_capability(weight.device)[0] >= 9


def weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int) -> Any:
    """A host-side TMA descriptor of ``weight`` read in ``[block_n, block_k]`` tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_n, block_k])
