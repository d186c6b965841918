"""Mixture-of-experts kernels (kernels/fused_moe.py, moe_sum.py, sparse_mlp.py) against their
references, and the references against the plain definition: the weighted sum of each
token's experts' gated MLPs. Routing and grouping are tests/test_kernels_moe_routing.py's.
Fresh random inputs each run (seed in messages).
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
from kernels.fused_moe import (
    SHARED_MEMORY_BYTES,
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    moe_tiles,
    tile_shared_bytes,
)
from kernels.moe_route_group import (
    FUSED_ROUTING_MAX_TOKENS,
)
from kernels.moe_routing import moe_route_ref
from kernels.moe_sum import (
    SLICE_FEATURES,
    SUM_IN_DOWN_MAX_TOKENS,
    moe_sum_add_pending_norm_triton,
    moe_sum_add_rms_norm_ref,
    moe_sum_add_rms_norm_triton,
)
from kernels.pending_norm import PendingNorm
from kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref
from kernels.sparse_mlp import moe_mlp, moe_mlp_add_rms_norm


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,top_k,hidden", [(1, 2, 64), (5, 3, 100)] + ([(64, 8, 2048)] if CUDA else [])
)
def test_sum_add_rms_norm_kernel_matches_reference(tokens, top_k, hidden, dtype):
    g = gen(tokens + top_k + hidden)
    per_pair = randn(tokens, top_k, hidden, g=g, dtype=torch.float32)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    weight = randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0
    with poisoned():
        normed, new_residual = moe_sum_add_rms_norm_triton(per_pair, residual, weight, 1e-6)
    want_normed, want_residual = moe_sum_add_rms_norm_ref(per_pair, residual, weight, 1e-6)
    check(new_residual, want_residual, f"residual {tokens}x{top_k}x{hidden}")
    check(normed, want_normed, f"normed {tokens}x{top_k}x{hidden}")


# The pending norm is taken only by 16-bit kernels; the CPU interpreter truncates float32 to
# bfloat16 where a GPU rounds, so there the tests use float16.
PENDING_DTYPES = [torch.float16] + ([torch.bfloat16] if CUDA else [])


@requires_triton
@pytest.mark.parametrize("dtype", PENDING_DTYPES)
@pytest.mark.parametrize(
    "tokens,top_k,hidden", [(1, 2, 64), (3, 3, 600)] + ([(64, 8, 2048)] if CUDA else [])
)
def test_sum_add_pending_norm_matches_reference(tokens, top_k, hidden, dtype):
    """The sum in slices of a row: the new residual, the weighted stream and each slice's
    sum of squares, which together are the reference's norm."""
    g = gen(tokens + top_k + hidden + 1)
    per_pair = randn(tokens, top_k, hidden, g=g, dtype=torch.float32)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    weight = randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0
    with poisoned():
        pending = moe_sum_add_pending_norm_triton(per_pair, residual, weight, 1e-6)
    want_normed, want_residual = moe_sum_add_rms_norm_ref(per_pair, residual, weight, 1e-6)
    what = f"{tokens}x{top_k}x{hidden} {dtype}"
    check(pending.hidden, want_residual, f"residual {what}")
    stream = pending.hidden.float()
    check(pending.weighted, (stream * weight.float()).to(dtype), f"weighted {what}")
    squares = pending.square_sums.sum(dim=1)
    torch.testing.assert_close(squares, (stream * stream).sum(dim=1), rtol=1e-5, atol=1e-5)
    assert pending.num_groups == -(-hidden // SLICE_FEATURES)
    check(pending.materialize(), want_normed, f"normed {what}")


def pending_input(tokens: int, hidden: int, dtype: torch.dtype, offset: int):
    """A PendingNorm as the o projection leaves it, and the norm it stands for (float32)."""
    g = gen(offset)
    per_pair = randn(tokens, 1, hidden, g=g, dtype=torch.float32)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    weight = randn(hidden, g=g, dtype=dtype, scale=0.2) + 1.0
    pending = moe_sum_add_pending_norm_triton(per_pair, residual, weight, 1e-6)
    return pending, rms_norm_ref(pending.hidden.float(), weight.float(), 1e-6)


@requires_triton
@pytest.mark.parametrize("dtype", PENDING_DTYPES)
@pytest.mark.parametrize("tokens", [1, 5] + ([64] if CUDA else []))
def test_sparse_mlp_takes_and_leaves_a_pending_norm(tokens, dtype, monkeypatch):
    """A pending input norm is applied by the first grouped GEMM; at decode rows the output
    norm is left pending, and it stands for the reference's."""
    import kernels.sparse_mlp as sparse_mlp

    hidden, inter, experts, top_k = (2048, 768, 128, 8) if CUDA else (80, 24, 6, 2)
    g = gen(tokens + 31)
    pending, normed = pending_input(tokens, hidden, dtype, tokens + 32)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=dtype, scale=inter**-0.5)
    logits = distinct_logits(tokens, experts, tokens)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    weight = randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0
    weights, chosen = moe_route_ref(logits.cpu(), top_k, True)
    args = (w13.cpu().float(), w2.cpu().float(), weights, chosen)
    want = fused_moe_ref(normed.cpu(), *args)
    want_normed, want_residual = fused_add_rms_norm_ref(
        want.to(dtype), residual.cpu(), weight.cpu(), 1e-6
    )
    monkeypatch.setattr(sparse_mlp, "use_triton", lambda t: True)
    with poisoned():
        out = moe_mlp(pending, logits, w13, w2, top_k, True)
        got_normed, new_residual = moe_mlp_add_rms_norm(
            pending, logits, w13, w2, top_k, True, residual, weight, 1e-6
        )
    what = f"{tokens} tokens {dtype}"
    check(out.cpu(), want.to(dtype), f"experts of a pending norm, {what}")
    assert isinstance(got_normed, PendingNorm), what
    assert got_normed.hidden is new_residual
    check(new_residual.cpu(), want_residual, f"residual, {what}")
    check(got_normed.materialize().cpu(), want_normed, f"pending output norm, {what}")


@requires_triton
@pytest.mark.parametrize("dtype", PENDING_DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_down_gemm_ending_in_the_sum_equals_the_sum_kernel(tokens, dtype, monkeypatch):
    """The down GEMM's last program of each feature tile sums the tokens' experts, adds the
    residual and writes the tile's slot: the sum kernel's outputs, twice in a row (its
    counters reset)."""
    import kernels.sparse_mlp as sparse_mlp

    hidden, inter, experts, top_k = (2048, 768, 128, 8) if CUDA else (128, 24, 6, 2)
    g = gen(tokens + 61)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=dtype, scale=inter**-0.5)
    weight = randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0
    monkeypatch.setattr(sparse_mlp, "use_triton", lambda t: True)
    for call in range(2):
        pending, _ = pending_input(tokens, hidden, dtype, tokens + 62 + call)
        logits = distinct_logits(tokens, experts, tokens + call)
        residual = randn(tokens, hidden, g=g, dtype=dtype)
        outputs = {}
        for folded in (False, True):
            monkeypatch.setattr(sparse_mlp, "sums_in_down", lambda *_, f=folded: f)
            with poisoned():
                outputs[folded] = moe_mlp_add_rms_norm(
                    pending, logits, w13, w2, top_k, True, residual, weight, 1e-6
                )[0]
        apart, folded = outputs[False], outputs[True]
        what = f"{tokens} tokens {dtype}, call {call}"
        assert isinstance(folded, PendingNorm), what
        assert torch.equal(folded.hidden, apart.hidden), what
        assert torch.equal(folded.weighted, apart.weighted), what
        torch.testing.assert_close(
            folded.square_sums, apart.square_sums, rtol=1e-5, atol=1e-6, msg=what
        )


@pytest.mark.parametrize(
    "setting,tokens,hidden,block_n,want",
    [
        ("8", 1, 2048, 64, True),
        ("8", 8, 2048, 64, True),
        ("8", 9, 2048, 64, False),
        ("8", 1, 2048, 128, False),  # tiles other than the norm's slices
        ("8", 1, 2000, 64, False),
        ("0", 1, 2048, 64, False),
        ("64", 64, 2048, 64, True),
        ("64", 64, 2048, 128, False),
        (None, 1, 2048, 64, SUM_IN_DOWN_MAX_TOKENS >= 1),
    ],
)
def test_sum_in_down_rule(setting, tokens, hidden, block_n, want, monkeypatch):
    from kernels import moe_sum

    def check_value():
        assert moe_sum.sums_in_down(tokens, hidden, block_n) is want

    check_setting(
        monkeypatch,
        "PEGAINFER_MOE_SUM_IN_DOWN",
        setting,
        moe_sum.sum_in_down_max_tokens,
        check_value,
        bad="-1",
        message="a token count",
    )


@requires_triton
def test_rows_past_the_fused_limit_get_the_norm_applied(monkeypatch):
    """Past the rows whose consumers apply a pending norm (and with the fusion off), the sum
    normalizes whole rows itself."""
    import kernels.sparse_mlp as sparse_mlp

    monkeypatch.setattr(sparse_mlp, "use_triton", lambda t: True)
    hidden, inter, experts, top_k = 32, 16, 4, 2
    g = gen(41)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=torch.float16, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=torch.float16, scale=inter**-0.5)
    weight = torch.ones(hidden, dtype=torch.float16, device=DEVICE)

    def normed_output(tokens: int):
        x = randn(tokens, hidden, g=g, dtype=torch.float16)
        logits = distinct_logits(tokens, experts, tokens)
        residual = randn(tokens, hidden, g=g, dtype=torch.float16)
        return moe_mlp_add_rms_norm(x, logits, w13, w2, top_k, True, residual, weight, 1e-6)[0]

    assert isinstance(normed_output(2), PendingNorm)  # the sum kernel, in slices
    assert isinstance(normed_output(65), torch.Tensor)
    monkeypatch.setenv("PEGAINFER_NORM_FUSION", "0")
    for tokens in (2, 6):
        x = randn(tokens, hidden, g=g, dtype=torch.float16)
        logits = distinct_logits(tokens, experts, tokens)
        residual = randn(tokens, hidden, g=g, dtype=torch.float16)
        normed, new_residual = moe_mlp_add_rms_norm(
            x, logits, w13, w2, top_k, True, residual, weight, 1e-6
        )
        weights, chosen = moe_route_ref(logits.cpu(), top_k, True)
        want = fused_moe_ref(x.cpu(), w13.cpu(), w2.cpu(), weights, chosen)
        want_normed, want_residual = fused_add_rms_norm_ref(
            want, residual.cpu(), weight.cpu(), 1e-6
        )
        check(new_residual.cpu(), want_residual, f"residual of {tokens} tokens, fusion off")
        check(normed.cpu(), want_normed, f"norm of {tokens} tokens, fusion off")


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


def check_setting(monkeypatch, name, value, cached, check_value, bad="on", message="0 or 1"):
    """``check_value()`` under ``name=value`` (unset for None), then a bad value refused."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    cached.cache_clear()
    try:
        check_value()
        monkeypatch.setenv(name, bad)
        cached.cache_clear()
        with pytest.raises(ValueError, match=f"{name} must be {message}"):
            check_value()
    finally:
        cached.cache_clear()


@pytest.mark.parametrize(
    "setting,early",
    [(None, fused_moe_module.DOWN_EARLY_TILE), ("1", True), ("0", False)],
)
def test_down_early_tile_setting(setting, early, monkeypatch):
    def check_value():
        assert fused_moe_module.down_early_tile() is early

    check_setting(
        monkeypatch,
        "PEGAINFER_MOE_DOWN_EARLY_TILE",
        setting,
        fused_moe_module.down_early_tile,
        check_value,
    )


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
