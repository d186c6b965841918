"""The experts' grouped GEMMs (kernels/fused_moe.py) and the whole sparse MLP against their
references, and the references against the plain definition: the weighted sum of each
token's experts' gated MLPs. Routing and grouping are tests/test_kernels_moe_routing.py's,
the experts' sum tests/test_kernels_moe_sum.py's. Fresh random inputs each run (seed in
messages).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_test_util import (
    CUDA,
    DEVICE,
    SEED,
    check,
    distinct_logits,
    gen,
    gpu_only,
    poisoned,
    randn,
    requires_triton,
)

import kernels.fused_moe as fused_moe_module
import kernels.moe_tiles as moe_tiles_module
from kernels.fused_moe import fused_moe, fused_moe_ref, fused_moe_triton
from kernels.moe_route_group import (
    FUSED_ROUTING_MAX_TOKENS,
)
from kernels.moe_routing import moe_route_ref
from kernels.moe_tiles import SHARED_MEMORY_BYTES, moe_tiles, tile_shared_bytes
from kernels.pending_norm import PendingNorm
from kernels.rmsnorm import fused_add_rms_norm_ref
from kernels.sparse_mlp import moe_mlp, moe_mlp_add_rms_norm


@requires_triton
@pytest.mark.parametrize("tokens", [1, 3, FUSED_ROUTING_MAX_TOKENS + 1])
def test_whole_sparse_mlp_matches_reference(tokens, monkeypatch):
    """Routing, grouping, both GEMMs and the sum with its add and norm, as the layer calls
    them, against the references (float32)."""
    import kernels.sparse_mlp as sparse_mlp

    hidden, inter, experts, top_k = 48, 24, 6, 2
    g = gen(tokens + 99)
    x = randn(tokens, hidden, g=g, dtype=torch.float32)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=torch.float32, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=torch.float32, scale=inter**-0.5)
    logits = distinct_logits(tokens, experts, tokens)
    residual = randn(tokens, hidden, g=g, dtype=torch.float32)
    weight = randn(hidden, g=g, dtype=torch.float32, scale=0.1) + 1.0
    weights, chosen = moe_route_ref(logits.cpu(), top_k, True)
    want = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights, chosen)
    want_normed, want_residual = fused_add_rms_norm_ref(want, residual.cpu(), weight.cpu(), 1e-6)
    monkeypatch.setattr(sparse_mlp, "use_triton", lambda t: True)
    with poisoned():
        out = moe_mlp(x, logits, w13, w2, top_k, True)
        normed, new_residual = moe_mlp_add_rms_norm(
            x, logits, w13, w2, top_k, True, residual, weight, 1e-6
        )
    check(out.cpu(), want, f"moe_mlp {tokens} tokens")
    check(new_residual.cpu(), want_residual, f"moe residual {tokens} tokens")
    check(normed.cpu(), want_normed, f"moe normed {tokens} tokens")


def _plain_moe(x, w13, w2, weights, experts):
    """The definition, token by token, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    half = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            proj = x[t].double() @ w13[e].double().T
            act = F.silu(proj[:half]) * proj[half:]
            out[t] += float(weights[t, j]) * (act @ w2[e].double().T)
    return out


def test_reference_matches_definition():
    tokens, hidden, inter, experts, top_k = 7, 24, 10, 5, 2
    x = torch.randn(tokens, hidden, generator=gen(3), dtype=torch.float64).float()
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen(4)).float() * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen(5)).float() * inter**-0.5
    weights, chosen = moe_route_ref(torch.randn(tokens, experts, generator=gen(6)), top_k, True)
    got = fused_moe_ref(x, w13, w2, weights, chosen)
    want = _plain_moe(x, w13, w2, weights, chosen)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


# (tokens, hidden, intermediate, experts, top_k): K and N not multiples of the tiles, one
# row, rows with experts in common; Qwen3-30B-A3B's experts on a GPU at decode and prefill.
MOE_SHAPES = [(1, 64, 48, 8, 2), (6, 72, 40, 4, 2), (40, 64, 32, 8, 3)] + (
    [(1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (600, 2048, 768, 128, 8)] if CUDA else []
)


@requires_triton
@pytest.mark.parametrize("early_tile", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", MOE_SHAPES)
def test_fused_moe_kernel_matches_reference(
    tokens, hidden, inter, experts, top_k, dtype, early_tile, monkeypatch
):
    """With the down GEMM's layout and first weight tile read before its wait and after."""
    monkeypatch.setattr(fused_moe_module, "down_early_tile", lambda: early_tile)
    g = gen(tokens + hidden + inter)
    x = randn(tokens, hidden, g=g, dtype=dtype)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=dtype, scale=inter**-0.5)
    logits = randn(tokens, experts, g=g, dtype=torch.float32)
    weights, chosen = moe_route_ref(logits, top_k, True)
    with poisoned():
        got = fused_moe_triton(x, w13, w2, weights, chosen)
    if CUDA or dtype != torch.bfloat16:
        want = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), chosen.cpu())
    else:
        want = _truncating_reference(x, w13, w2, weights, chosen)
    check(got.cpu(), want, f"fused MoE {tokens} tokens {experts} experts top {top_k} {dtype}")


def _truncated(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` cut to bfloat16's 8 bits of mantissa (toward zero), kept in float32."""
    return (t.contiguous().view(torch.int32) & -65536).view(torch.float32)


def _truncating_reference(x, w13, w2, weights, experts):
    """The bfloat16 reference with the roundings of Triton's CPU interpreter, which truncates
    float32 -> bfloat16 where a GPU rounds; over three such casts in a row the difference
    passes the bfloat16 tolerance."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    half = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            proj = _truncated(x[t : t + 1].float() @ w13[e].float().T)
            act = _truncated(F.silu(proj[:, :half]) * proj[:, half:])
            out[t] += float(weights[t, j]) * (act @ w2[e].float().T)[0]
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 32, 33, 256, 257, 8192])
def test_tiles_fit_shared_memory(tokens, dtype):
    """A tile past the SM's shared memory fails only at its first launch on a GPU."""
    size = torch.empty((), dtype=dtype).element_size()
    tiles = moe_tiles(tokens, size)
    assert tile_shared_bytes(tiles, size) <= SHARED_MEMORY_BYTES, (tiles, dtype)
    # The rule's own measure: Triton asked for 294,912 bytes for (16, 64, 256) in float32.
    assert tile_shared_bytes((16, 64, 256, 4), 4) == 294912


@pytest.mark.parametrize(
    "setting,early",
    [(None, moe_tiles_module.DOWN_EARLY_TILE), ("1", True), ("0", False)],
)
def test_down_early_tile_setting(setting, early, monkeypatch):
    """Unset it is the default; 0 or 1 chooses; anything else is refused (read once)."""
    name, read = "PEGAINFER_MOE_DOWN_EARLY_TILE", moe_tiles_module.down_early_tile
    if setting is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, setting)
    read.cache_clear()
    try:
        assert read() is early
        monkeypatch.setenv(name, "on")
        read.cache_clear()
        with pytest.raises(ValueError, match=f"{name} must be 0 or 1"):
            read()
    finally:
        read.cache_clear()


def test_dispatch_runs_the_reference_on_cpu():
    x = torch.randn(3, 16)
    w13, w2 = torch.randn(4, 8, 16), torch.randn(4, 16, 4)
    weights, chosen = moe_route_ref(torch.randn(3, 4), 2, False)
    torch.testing.assert_close(
        fused_moe(x, w13, w2, weights, chosen), fused_moe_ref(x, w13, w2, weights, chosen)
    )


@gpu_only
@pytest.mark.parametrize("tokens", [1, 8, 64, 100, 300])
@pytest.mark.parametrize("path", ["mlp_add_norm", "given_routing"])
def test_moe_in_a_cuda_graph_equals_eager(tokens, path):
    """Replayed from a CUDA graph, as decode steps run it, the sparse MLP gives what it gives
    eagerly, on both sides of FUSED_ROUTING_MAX_TOKENS, and with routing passed in."""
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    g = gen(tokens + 7)
    x = randn(tokens, hidden, g=g, dtype=torch.bfloat16)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=torch.bfloat16, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=torch.bfloat16, scale=inter**-0.5)
    logits = randn(tokens, experts, g=g, dtype=torch.bfloat16)
    residual = randn(tokens, hidden, g=g, dtype=torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16, device=DEVICE)
    weights, chosen = moe_route_ref(logits, top_k, True)

    def run():
        if path == "given_routing":
            return (fused_moe_triton(x, w13, w2, weights, chosen),)
        return moe_mlp_add_rms_norm(x, logits, w13, w2, top_k, True, residual, weight, 1e-6)

    def tensors(outputs):
        for out in outputs:
            if isinstance(out, PendingNorm):
                yield from (out.hidden, out.weighted, out.square_sums)
            else:
                yield out

    eager = list(tensors(run()))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = list(tensors(run()))
    for out in captured:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want), f"{path} at {tokens} tokens (seed {SEED})"


@pytest.mark.skipif(CUDA, reason="on a GPU the golden tests run these kernels in the model")
def test_tiny_qwen3_moe_runs_the_same_on_triton_kernels(tmp_path, monkeypatch):
    """The sparse MLP's kernels in the real model (decode steps of one and two sequences,
    prefill chunks), against the references: the same greedy tokens."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from worker_helpers import engine_config, make_tiny_checkpoint, mixed_greedy_tokens

    import kernels.sparse_mlp as sparse_mlp
    from worker_proc.model_runner import ModelRunner

    runner = ModelRunner(engine_config(make_tiny_checkpoint(str(tmp_path), "qwen3_moe", seed=2)))

    expected = mixed_greedy_tokens(runner)
    monkeypatch.setattr(sparse_mlp, "use_triton", lambda tensor: True)
    assert mixed_greedy_tokens(runner) == expected, f"seed {SEED}"
