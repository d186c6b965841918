"""How many KV blocks a worker gets: the bytes a config names, a CPU default, or what is left
of the GPU after a dummy forward of the largest step the scheduler may send (the profile
run). The rules are in worker_proc/kv_cache.py."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from kernels.compile_ahead import compile_for
from pegainfer.config import EngineConfig
from worker_proc.batch import StepBatch, build_batch
from worker_proc.graph_capture import compile_ahead_key, compile_layers
from worker_proc.kv_cache import (
    KVCacheSpec,
    allocate_kv_cache,
    default_cpu_kv_bytes,
    profiled_kv_bytes,
)
from worker_proc.layers.attention import bind_kv_caches

logger = logging.getLogger(__name__)

Forward = Callable[[StepBatch], torch.Tensor]
# Compiles ahead what a profile run launches (given the run and the settings that pick its
# kernels); True when it ran the run with its launches caught.
CompilePass = Callable[[Callable[[], torch.Tensor], tuple], bool]


def decide_num_blocks(
    config: EngineConfig,
    kv_spec: KVCacheSpec,
    model: nn.Module,
    device: torch.device,
    forward: Forward,
    compile_pass: CompilePass | None = None,
) -> int:
    """``compile_pass``: how the profile run's kernels are compiled ahead (default: on their
    own, ``compile_for``); the runner passes one that compiles the graph captures' too."""
    if config.kv_cache_memory > 0:
        kv_bytes = config.kv_cache_memory
    elif device.type == "cuda":
        kv_bytes = profile_kv_bytes(config, kv_spec, model, device, forward, compile_pass)
    else:
        kv_bytes = default_cpu_kv_bytes(config, kv_spec)
    return max(kv_bytes // kv_spec.bytes_per_block, 0)


@torch.inference_mode()
def profile_kv_bytes(
    config: EngineConfig,
    kv_spec: KVCacheSpec,
    model: nn.Module,
    device: torch.device,
    forward: Forward,
    compile_pass: CompilePass | None = None,
) -> int:
    """Run the largest batch the scheduler may send and see how much memory is left."""
    lengths, remaining = [], config.max_num_batched_tokens
    while remaining > 0 and len(lengths) < config.max_num_seqs:
        lengths.append(min(remaining, config.max_model_len))
        remaining -= lengths[-1]
    temp_blocks = sum(kv_spec.blocks_for_tokens(n) for n in lengths)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    temp_storage, temp_caches = allocate_kv_cache(kv_spec, temp_blocks, device)
    bind_kv_caches(model, temp_caches)
    tables, next_block = [], 0
    for n in lengths:
        count = kv_spec.blocks_for_tokens(n)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    tokens = [[0] * n for n in lengths]
    batch = build_batch(tokens, tables, [0] * len(lengths), lengths, kv_spec.block_size, device)

    def run(batch: StepBatch = batch) -> torch.Tensor:
        hidden = forward(batch)
        # The logits of a full decode batch are the other large transient.
        rows = min(config.max_num_seqs, hidden.shape[0])
        model.compute_logits(hidden[:rows]).float().softmax(dim=-1)
        return hidden

    settings = (kv_spec, lengths, config.max_num_seqs)
    if compile_pass is None:
        key = compile_ahead_key("profile run", model, *settings)

        def compile_pass(run: Callable[[], torch.Tensor], settings: tuple) -> bool:
            def fewer_layers() -> None:
                with compile_layers(model):
                    run()

            return compile_for(fewer_layers, "profile run", key) is not None

    if compile_pass(run, settings):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)  # the caught run's transients add nothing
    hidden = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - temp_storage.nbytes
    del temp_storage, temp_caches, hidden, batch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)
    kv_bytes = profiled_kv_bytes(config.gpu_memory_utilization, total, peak, outside_torch)
    logger.info(
        "profile: peak %.2f GiB at %d tokens, %.2f GiB held outside torch, %.2f GiB total "
        "-> %.2f GiB for the KV cache",
        peak / 2**30,
        sum(lengths),
        outside_torch / 2**30,
        total / 2**30,
        kv_bytes / 2**30,
    )
    return kv_bytes
