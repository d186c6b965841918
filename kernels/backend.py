"""Which implementation of a kernel runs for a given tensor.

Every kernel module holds a plain PyTorch reference (``*_ref``) and a public dispatch
function. Triton variants (``*_triton``) are added beside the references later; their
dispatchers then ask ``use_triton`` so that CPU tensors, and machines without Triton, keep
running the references. ``PEGAINFER_KERNELS=ref`` forces the references everywhere, which is
how a suspected kernel bug is bisected.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_available() -> bool:
    if os.environ.get("PEGAINFER_KERNELS", "").lower() == "ref":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(tensor: torch.Tensor) -> bool:
    """True when a Triton variant may run on ``tensor``'s device."""
    return tensor.is_cuda and _triton_available()
