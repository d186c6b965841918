"""A step's small copies between pinned host memory and the device, done by a kernel.

Every step uploads a few hundred bytes of index arrays and reads back its sampled tokens. As
DMA transfers (``copy_(..., non_blocking=True)``) each left the GPU idle for about 7 us
before it ran on an H200 (the copy engine takes over from the compute queue), some 14 us of
a 2.4 ms batch-1 step. Pinned host memory is mapped into the device's address space, so a
kernel can read or write it directly over the bus instead: one launch in the stream like any
other kernel.

``copy_ref`` is the reference (the DMA copy); ``copy_pinned`` picks the kernel for a pinned
host tensor and a CUDA tensor of the same bytes, unless ``PEGAINFER_ZERO_COPY=0``. The
caller orders the host's own use of the pinned memory behind the kernel with an event, as it
would behind the copy.

``tokens_out`` is a step's sampled tokens on their two ways at once: to the host, and into
the per-slot ``last_token`` that the next step's inputs read (worker_proc/seq_slots.py). One
launch instead of a scatter and a copy, each of which left the GPU idle for 1-2 us between
two decode steps on an H200.
"""

from __future__ import annotations

import functools
import os

import torch

from kernels.backend import cdiv, load_triton, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

# 32-bit words a program copies.
BLOCK_WORDS = 1024


def copy_ref(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


@triton_jit(do_not_specialize=("num_words",))
def _copy_kernel(src_ptr, dst_ptr, num_words, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_words
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


@triton_jit(do_not_specialize=("num_tokens",))
def _tokens_out_kernel(
    tokens_ptr, host_ptr, last_token_ptr, slots_ptr, num_tokens, BLOCK: tl.constexpr
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_tokens
    tokens = tl.load(tokens_ptr + offsets, mask=mask)
    slots = tl.load(slots_ptr + offsets, mask=mask, other=0)
    tl.store(host_ptr + offsets, tokens, mask=mask)
    tl.store(last_token_ptr + slots, tokens, mask=mask)


def tokens_out_ref(
    host: torch.Tensor, tokens: torch.Tensor, last_token: torch.Tensor, slots: torch.Tensor
) -> None:
    last_token.index_copy_(0, slots, tokens)
    copy_pinned(host, tokens)


def tokens_out(
    host: torch.Tensor, tokens: torch.Tensor, last_token: torch.Tensor, slots: torch.Tensor
) -> None:
    """``last_token[slots] = tokens`` and ``host.copy_(tokens)`` (``host`` pinned), in one
    kernel where ``copy_pinned`` would run one; all int64, ``slots`` on the device."""
    if not (tokens.shape == slots.shape == host.shape and tokens.dim() == 1):
        raise ValueError(
            f"tokens {tuple(tokens.shape)}, slots {tuple(slots.shape)} and host "
            f"{tuple(host.shape)} must be one vector's length"
        )
    same = tokens.dtype == host.dtype == last_token.dtype == slots.dtype == torch.int64
    flat = slots.is_contiguous() and last_token.is_contiguous()
    if not same or not flat or not kernel_copies(host, tokens):
        tokens_out_ref(host, tokens, last_token, slots)
        return
    num_tokens = tokens.numel()
    if num_tokens == 0:
        return
    load_triton()
    _tokens_out_kernel[(cdiv(num_tokens, BLOCK_WORDS),)](
        tokens, host, last_token, slots, num_tokens, BLOCK=BLOCK_WORDS, num_warps=4
    )


@functools.cache
def _enabled() -> bool:
    return os.environ.get("PEGAINFER_ZERO_COPY", "1").lower() not in ("0", "off", "false", "no")


def _words(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s bytes as int32 words, where it is contiguous and 4-byte aligned."""
    num_bytes = tensor.numel() * tensor.element_size()
    if not tensor.is_contiguous() or num_bytes % 4 or tensor.data_ptr() % 4:
        return None
    return tensor.view(-1).view(torch.uint8).view(torch.int32) if num_bytes else None


def kernel_copies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``copy_pinned(dst, src)`` runs the kernel: one side pinned host memory, the
    other a CUDA tensor Triton runs on, the same bytes, contiguous and 4-byte aligned."""
    if not _enabled():
        return False
    device_side, host_side = (dst, src) if dst.is_cuda else (src, dst)
    if not device_side.is_cuda or host_side.is_cuda or not host_side.is_pinned():
        return False
    if dst.numel() * dst.element_size() != src.numel() * src.element_size():
        return False
    return use_triton(device_side) and _words(dst) is not None and _words(src) is not None


def copy_pinned(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` between pinned host memory and the device,
    as a kernel where ``kernel_copies`` says so."""
    if not kernel_copies(dst, src):
        copy_ref(dst, src)
        return
    dst_words, src_words = _words(dst), _words(src)
    num_words = src_words.numel()
    load_triton()
    _copy_kernel[(cdiv(num_words, BLOCK_WORDS),)](
        src_words, dst_words, num_words, BLOCK=BLOCK_WORDS, num_warps=4
    )
