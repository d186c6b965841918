"""Tensor-parallel group of this worker: its rank, the group size, and the collectives the
layers need.

With one rank every collective returns its input and torch.distributed is never touched.
With several, ``init_distributed`` joins a process group (NCCL on CUDA, gloo on CPU, so TP
correctness is testable without GPUs) through a rendezvous file in the run directory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pegainfer.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class _TPState:
    rank: int = 0
    size: int = 1


_state = _TPState()


def get_tp_rank() -> int:
    return _state.rank


def get_tp_size() -> int:
    return _state.size


def init_distributed(config: EngineConfig, rank: int, device: torch.device | None = None) -> None:
    """Join the tensor-parallel group as ``rank`` of ``config.tensor_parallel_size``."""
    size = config.tensor_parallel_size
    if not 0 <= rank < max(size, 1):
        raise ValueError(f"rank {rank} is outside tensor parallel size {size}")
    _state.rank, _state.size = rank, max(size, 1)
    if _state.size == 1 or (dist.is_available() and dist.is_initialized()):
        return
    backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    if not config.run_dir:
        raise ValueError("tensor parallelism needs a run directory for the rendezvous file")
    init_file = os.path.join(config.run_dir, "tp_rendezvous")
    dist.init_process_group(
        backend=backend,
        init_method=f"file://{init_file}",
        world_size=_state.size,
        rank=rank,
        device_id=device if backend == "nccl" else None,
    )
    logger.info("joined tensor parallel group: rank %d of %d (%s)", rank, _state.size, backend)


def destroy_distributed() -> None:
    if _state.size > 1 and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _state.rank, _state.size = 0, 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP group (the partial outputs of a row-parallel layer)."""
    if _state.size == 1:
        return x
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (the vocab shards of the logits)."""
    if _state.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
