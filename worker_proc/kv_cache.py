"""Sizing and allocation of the paged KV cache.

Each layer gets ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads_per_rank,
head_dim]``, views into one allocation ``[num_layers, 2, num_blocks, ...]``.

How many blocks:
- ``config.kv_cache_memory > 0``: that many bytes, on any device.
- CPU, otherwise: enough for ``max_num_seqs`` full-length sequences, capped at 1 GiB
  (host memory is shared with everything else, so the default stays modest).
- CUDA, otherwise: profiled. The model runs one dummy forward at
  ``max_num_batched_tokens`` tokens; the cache gets ``gpu_memory_utilization * total``
  minus the peak that forward reached and minus what other users of the GPU hold.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pegainfer.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @classmethod
    def for_model(cls, model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """The cache of ``model``'s attention layers (all alike) on this rank."""
        from worker_proc.layers.attention import Attention

        layers = [m for m in model.modules() if isinstance(m, Attention)]
        return cls(len(layers), layers[0].num_kv_heads, layers[0].head_dim, block_size, dtype)


def default_cpu_kv_bytes(config: EngineConfig, spec: KVCacheSpec) -> int:
    wanted = config.max_num_seqs * spec.blocks_for_tokens(config.max_model_len)
    return min(DEFAULT_CPU_KV_BYTES, wanted * spec.bytes_per_block)


def profiled_kv_bytes(
    utilization: float, total_bytes: int, peak_allocated: int, held_outside_torch: int
) -> int:
    """Memory left for the KV cache on a GPU after the profile run.

    ``held_outside_torch`` is what this process's allocator does not account for (CUDA
    context, other processes on the same GPU); ``peak_allocated`` is the allocator's peak
    while the model ran its largest batch, weights included.
    """
    return int(utilization * total_bytes) - peak_allocated - held_outside_torch


def check_capacity(num_blocks: int, block_size: int, max_model_len: int) -> None:
    capacity = num_blocks * block_size
    if num_blocks <= 0 or capacity < max_model_len:
        raise RuntimeError(
            f"the KV cache holds {max(capacity, 0)} tokens, fewer than --max-model-len "
            f"{max_model_len}; lower --max-model-len or raise --kv-cache-memory / "
            "--gpu-memory-utilization"
        )


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """One allocation for every layer; returns it and the per-layer ``(k, v)`` views."""
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cuda":
        # Zeroed, so that a kernel reading a padded slot multiplies finite values by 0.
        storage = torch.zeros(shape, dtype=spec.dtype, device=device)
    else:
        # Uninitialised: host pages are only touched as sequences fill them. The reference
        # kernels never read a slot that was not written.
        storage = torch.empty(shape, dtype=spec.dtype, device=device)
    layers = [(storage[i, 0], storage[i, 1]) for i in range(spec.num_layers)]
    return storage, layers


def log_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens, %.1f MiB on %s (%s)",
        num_blocks,
        spec.block_size,
        num_blocks * spec.block_size,
        num_blocks * spec.bytes_per_block / (1 << 20),
        device,
        str(spec.dtype).removeprefix("torch."),
    )
