"""Capturing every graph a worker replays: decode graphs, then short-prefill graphs.

Both kinds share the backend's memory pool. A capture that fails (a kernel that syncs with
the host, say) is logged and leaves that kind of step eager; serving still works.

``compile_graph_kernels`` goes through the same captures first with ``CompileOnlyBackend``,
under ``kernels.compile_ahead``: each capture's function runs once with its Triton launches
caught, so every kernel variant the captures need compiles in parallel before the real
warm-up runs launch them one after another.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import kernels
from kernels.compile_ahead import CompileAheadReport, compile_for, fingerprint
from kernels.host_copy import copy_pinned, tokens_out
from kernels.sampling_candidates import race_candidates
from kernels.sampling_nucleus import race_nucleus
from kernels.sampling_race import race_rows
from kernels.top_candidates import top_candidates
from pegainfer.config import EngineConfig
from pegainfer.startup_timeline import StartupTimeline
from worker_proc.cuda_graphs import DecodeGraphs, GraphBackend, Replay, capture_sizes
from worker_proc.layers.attention import Attention
from worker_proc.parallel_state import get_tp_size
from worker_proc.prefill_graphs import MAX_SEQS, PrefillGraphs, prefill_token_sizes
from worker_proc.sampler import CANDIDATES

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
    # The eager prefills' attention tiles, which no graph launches: compiled in the compile
    # pass, loaded ahead of the first long prompt here.
    longest = min(config.max_num_batched_tokens, config.max_model_len)
    attention = next((m for m in model.modules() if isinstance(m, Attention)), None)
    if attention is not None and longest > 0:
        attention.launch_eager_prefills(longest)
    decode = DecodeGraphs(
        capture_sizes(config.max_num_seqs),
        max_blocks_per_seq,
        config.max_model_len,
        vocab_size,
        dtype,
        device,
    )

    def forward_logits(
        input_ids: torch.Tensor, positions: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        return model.compute_logits(model(input_ids, positions), out)

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


def compile_layers(model: nn.Module) -> contextlib.AbstractContextManager:
    """The layers a compile pass's forwards run: the model's representative few
    (``representative_layers``, a 36-layer Qwen3-4B: 3), so that its forwards make a tenth
    of the caught launches (716 against 7,085); every layer with ``PEGAINFER_COMPILE_LAYERS=all``, or where the
    model names none. Fewer layers only miss a variant the others would launch, and that one
    compiles at its first launch in the captures: slower, never wrong."""
    inner = getattr(model, "model", model)
    narrow = getattr(inner, "representative_layers", None)
    if narrow is None or os.environ.get("PEGAINFER_COMPILE_LAYERS", "few") == "all":
        return contextlib.nullcontext()
    return narrow()


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
    profile_run: Callable[[], torch.Tensor] | None = None,
    profile_settings: tuple = (),
) -> CompileAheadReport | None:
    """Compile, in parallel, every Triton kernel that ``capture_graphs`` will launch, and the
    sampler's; None where that is not possible (the captures then compile as they go).

    With ``profile_run`` (the KV profile's forward, over a temporary cache) its kernels
    compile in the same pass, so that the two sets overlap rather than wait for each other.
    The captures then run over that temporary cache: no kernel specializes on the cache's
    block count (only on its strides, which do not depend on it)."""

    def outside_graphs() -> None:
        # The sampler's kernels, which no graph takes: the argmax of penalised (float32)
        # rows, and the race, the top-p / min-p search and the top candidates over the model's
        # logits and over edited float32 ones; and every step's upload and token readback
        # (kernels/host_copy.py): one variant each.
        kernels.argmax_rows(torch.empty((1, vocab_size), dtype=torch.float32, device=device))
        row = torch.zeros(1, dtype=torch.int64, device=device)
        for values_dtype in dict.fromkeys((dtype, torch.float32)):
            values = torch.zeros((1, vocab_size), dtype=values_dtype, device=device)
            race_rows(values, torch.ones(1, device=device), row, row, 0)
            ones = torch.ones(1, device=device)
            race_nucleus(values, ones, ones, ones, row, row, 0)
            top_candidates(values, min(CANDIDATES, vocab_size))
        # The candidate path's four variants (with and without top-p, min-p).
        width = min(CANDIDATES, vocab_size)
        values = torch.zeros((1, width), device=device)
        ids = torch.zeros((1, width), dtype=torch.int64, device=device)
        cut = torch.ones(1, device=device)
        for top_p, min_p in itertools.product((None, cut), (None, cut)):
            race_candidates(values, ids, row + 1, top_p, min_p, row, row, 0)
        words = torch.empty(64, dtype=torch.int32, device=device)
        copy_pinned(words, torch.empty(64, dtype=torch.int32, pin_memory=True))
        tokens = torch.zeros(2, dtype=torch.int64, device=device)
        host = torch.empty(2, dtype=torch.int64, pin_memory=True)
        tokens_out(host, tokens, torch.zeros(2, dtype=torch.int64, device=device), tokens)

    def dry_run() -> None:
        # First: the pass ends when the last variant found has compiled, so each is best
        # found early.
        if device.type == "cuda":
            outside_graphs()
        with compile_layers(model):
            if profile_run is not None:
                profile_run()
            capture_graphs(
                model, config, vocab_size, max_blocks_per_seq, dtype, device, CompileOnlyBackend()
            )

    what = "graph capture" if profile_run is None else "profile run and graph capture"
    key = compile_ahead_key(
        what,
        model,
        *profile_settings,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        config.max_model_len,
        max_blocks_per_seq,
        vocab_size,
        str(dtype),
    )
    report = compile_for(dry_run, what, key)
    if device.type == "cuda":
        # Run for real as well. Where an earlier start-up noted the pass and it was skipped,
        # the captures load their kernels from Triton's disk cache, but nothing loads these:
        # the first step would, 1-5 ms inside it, logged as a late compile.
        outside_graphs()
    return report


class KernelCompile:
    """The start-up's compile-ahead pass for a worker that captures CUDA graphs: together with
    the KV profile run where the cache is profiled (``with_profile``, handed to
    ``decide_num_blocks``), over the captures alone otherwise (``graphs_alone``)."""

    def __init__(self, capture_args: tuple, timeline: StartupTimeline) -> None:
        self.capture_args = capture_args
        self.timeline = timeline
        self.done = False

    def with_profile(self, profile_run: Callable[[], torch.Tensor], settings: tuple) -> bool:
        """True when the profile run ran caught (its transients then count for nothing)."""
        report = compile_graph_kernels(*self.capture_args, profile_run, settings)
        self.done = True
        self.timeline.mark("kernel compile")
        return report is not None

    def graphs_alone(self) -> None:
        if not self.done:
            compile_graph_kernels(*self.capture_args)
            self.done = True
            self.timeline.mark("kernel compile")


def release_warm_up_memory(device: torch.device) -> None:
    """Give back what the eager warm-up runs left in the allocator's cache (the capture
    keeps it, so that each warm-up reuses the last one's blocks)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
