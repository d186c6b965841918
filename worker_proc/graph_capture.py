"""Capturing every graph a worker replays: decode graphs, then short-prefill graphs.

Both kinds share the backend's memory pool. A capture that fails (a kernel that syncs with
the host, say) is logged and leaves that kind of step eager; serving still works.

``compile_graph_kernels`` goes through the same captures first with ``CompileOnlyBackend``,
under ``kernels.compile_ahead``: each capture's function runs once with its Triton launches
caught, so every kernel variant the captures need compiles in parallel before the real
warm-up runs launch them one after another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels.compile_ahead import CompileAheadReport, compile_for, fingerprint
from pegainfer.config import EngineConfig
from worker_proc.cuda_graphs import DecodeGraphs, GraphBackend, Replay, capture_sizes
from worker_proc.parallel_state import get_tp_size
from worker_proc.prefill_graphs import MAX_SEQS, PrefillGraphs, prefill_token_sizes

logger = logging.getLogger(__name__)


class CompileOnlyBackend:
    """Runs each function once and records nothing (see ``compile_graph_kernels``)."""

    records = False

    def capture(self, fn: Callable[[], torch.Tensor]) -> Replay:
        fn()

        def replay() -> torch.Tensor:
            raise RuntimeError("a compile-only capture has nothing to replay")

        return replay


@dataclass
class CapturedGraphs:
    decode: DecodeGraphs | None = None
    prefill: PrefillGraphs | None = None
    seconds: float = 0.0


@torch.inference_mode()
def capture_graphs(
    model: nn.Module,
    config: EngineConfig,
    vocab_size: int,
    max_blocks_per_seq: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: GraphBackend,
) -> CapturedGraphs:
    captured = CapturedGraphs()
    decode = DecodeGraphs(
        capture_sizes(config.max_num_seqs),
        max_blocks_per_seq,
        config.max_model_len,
        vocab_size,
        dtype,
        device,
    )

    def forward_logits(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions))

    records = getattr(backend, "records", True)
    try:
        captured.seconds = decode.capture(forward_logits, backend)
    except Exception:
        if not records:
            raise
        logger.warning("decode graph capture failed; running eagerly", exc_info=True)
        return captured
    captured.decode = decode
    token_sizes = prefill_token_sizes(config.max_num_batched_tokens)
    if not token_sizes:
        return captured
    prefill = PrefillGraphs(
        token_sizes,
        min(MAX_SEQS, config.max_num_seqs),
        max_blocks_per_seq,
        config.max_model_len,
        vocab_size,
        dtype,
        device,
    )
    try:
        captured.seconds += prefill.capture(model, model.compute_logits, backend)
    except Exception:
        if not records:
            raise
        logger.warning("prefill graph capture failed; short prefills run eagerly", exc_info=True)
        return captured
    captured.prefill = prefill
    return captured


def compile_ahead_key(what: str, model: nn.Module, *settings: object) -> str | None:
    """The key under which a finished compile-ahead pass is noted (kernels/compile_ahead.py).
    None with several ranks, where every rank runs its pass: one that skipped it would meet
    the other ranks' collectives out of step."""
    if get_tp_size() > 1:
        return None
    return fingerprint(what, model, *settings)


def compile_graph_kernels(
    model: nn.Module,
    config: EngineConfig,
    vocab_size: int,
    max_blocks_per_seq: int,
    dtype: torch.dtype,
    device: torch.device,
) -> CompileAheadReport | None:
    """Compile, in parallel, every Triton kernel that ``capture_graphs`` will launch, and the
    sampler's; None where that is not possible (the captures then compile as they go)."""

    def dry_run() -> None:
        capture_graphs(
            model, config, vocab_size, max_blocks_per_seq, dtype, device, CompileOnlyBackend()
        )
        # The sampler's argmax over float32 rows, which no graph takes.
        kernels.argmax_rows(torch.empty((1, vocab_size), dtype=torch.float32, device=device))

    key = compile_ahead_key(
        "graph capture",
        model,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_model_len,
        max_blocks_per_seq,
        vocab_size,
        str(dtype),
    )
    return compile_for(dry_run, "graph capture", key)


def release_warm_up_memory(device: torch.device) -> None:
    """Give back what the eager warm-up runs left in the allocator's cache (the capture
    keeps it, so that each warm-up reuses the last one's blocks)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
