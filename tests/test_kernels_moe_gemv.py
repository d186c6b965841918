"""The experts of a few decode tokens as GEMVs (kernels/moe_gemv.py) against the reference:
plain float32 sums, a pending input norm, and the residual add with the output norm left
pending. Fresh random inputs each run (seed in messages)."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import (
    CUDA,
    DEVICE,
    SEED,
    check,
    gen,
    gpu_only,
    poisoned,
    randn,
    requires_triton,
)

from kernels.attention_merge import split_counters
from kernels.fused_moe import fused_moe_triton
from kernels.moe_gemv import (
    gemv_max_tokens,
    moe_gemv_ref,
    moe_gemv_routed_triton,
    moe_gemv_triton,
    tiles_now,
)
from kernels.moe_routing import moe_route_ref
from kernels.moe_sum import moe_sum_add_pending_norm_triton
from kernels.pending_norm import PendingNorm
from kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref

pytestmark = requires_triton

# (tokens, hidden, intermediate, experts, top_k): K past a whole tile and features past a
# whole tile (odd), tokens sharing experts; Qwen3-30B-A3B's experts on a GPU.
SHAPES = [(1, 64, 48, 8, 2), (3, 600, 41, 4, 3)] + (
    [(1, 2048, 768, 128, 8), (4, 2048, 768, 128, 8)] if CUDA else []
)
# The CPU interpreter truncates float32 to bfloat16 where a GPU rounds: float16 there.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def _experts(tokens, hidden, inter, experts, top_k, dtype, offset, with_logits=False):
    g = gen(offset)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=dtype, scale=inter**-0.5)
    # Distinct logits in a row, so that the top-k set is unambiguous.
    ranks = torch.stack([torch.randperm(experts, generator=g) for _ in range(tokens)])
    logits = (ranks.float() * 0.37 + 0.05 * torch.rand(tokens, experts, generator=g)).to(DEVICE)
    weights, chosen = moe_route_ref(logits, top_k, True)
    if with_logits:
        return w13, w2, weights, chosen, logits
    return w13, w2, weights, chosen


def _reference(x, w13, w2, weights, chosen):
    return moe_gemv_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), chosen.cpu())


def _counters_clear() -> bool:
    return not torch.count_nonzero(split_counters(1, DEVICE)[:4096]).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", SHAPES)
def test_gemv_matches_reference(tokens, hidden, inter, experts, top_k, dtype):
    w13, w2, weights, chosen = _experts(tokens, hidden, inter, experts, top_k, dtype, tokens)
    x = randn(tokens, hidden, g=gen(tokens + 1), dtype=dtype)
    with poisoned():
        got = moe_gemv_triton(x, w13, w2, weights, chosen)
    want = _reference(x, w13, w2, weights, chosen)
    check(got.cpu(), want, f"MoE GEMV {tokens}x{hidden}x{inter} top {top_k} {dtype}")
    # The reference's float32 sum rounds once to the dtype, as the grouped GEMMs' does.
    check(got.to(dtype).cpu(), want.to(dtype), f"rounded, {dtype}")


def pending_input(tokens: int, hidden: int, dtype: torch.dtype, offset: int):
    """A PendingNorm as the o projection leaves it, and the norm it stands for (float32)."""
    g = gen(offset)
    per_pair = randn(tokens, 1, hidden, g=g, dtype=torch.float32)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    weight = randn(hidden, g=g, dtype=dtype, scale=0.2) + 1.0
    pending = moe_sum_add_pending_norm_triton(per_pair, residual, weight, 1e-6)
    return pending, rms_norm_ref(pending.hidden.float(), weight.float(), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", SHAPES)
def test_gemv_takes_and_leaves_a_pending_norm(tokens, hidden, inter, experts, top_k, dtype):
    """The input's norm applied by the gate/up GEMV; the down GEMV ends in the residual add
    and leaves the next norm pending, its slots' sums the new residual's squares."""
    w13, w2, weights, chosen = _experts(tokens, hidden, inter, experts, top_k, dtype, tokens + 5)
    pending, normed = pending_input(tokens, hidden, dtype, tokens + 6)
    g = gen(tokens + 7)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    norm_weight = randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0
    with poisoned():
        summed = moe_gemv_triton(pending, w13, w2, weights, chosen)
        out = moe_gemv_triton(pending, w13, w2, weights, chosen, residual, norm_weight, 1e-6)
    what = f"{tokens}x{hidden}x{inter} top {top_k} {dtype}"
    # The norm rounded to the dtype before the products, as the reference rounds it.
    want = _reference(normed.to(dtype), w13, w2, weights, chosen)
    check(summed.to(dtype).cpu(), want.to(dtype), f"experts of a pending norm, {what}")
    want_normed, want_residual = fused_add_rms_norm_ref(
        want.to(dtype), residual.cpu(), norm_weight.cpu(), 1e-6
    )
    assert isinstance(out, PendingNorm)
    check(out.hidden.cpu(), want_residual, f"new residual, {what}")
    stream = out.hidden.float()
    check(out.weighted, (stream * norm_weight.float()).to(dtype), f"weighted stream, {what}")
    torch.testing.assert_close(
        out.square_sums.sum(dim=1), (stream * stream).sum(dim=1), rtol=1e-5, atol=1e-4
    )
    check(out.materialize().cpu(), want_normed, f"pending output norm, {what}")
    assert _counters_clear(), "the slot counters are left zeroed for the next launch"


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", SHAPES)
def test_gemv_routes_inside_the_gate_up_kernel(tokens, hidden, inter, experts, top_k, renormalize):
    """Routed from the router's logits inside the gate/up kernel: the routing kernel's
    function, in bf16 logits as the router gives them, with and without renormalising."""
    dtype = torch.float16 if not CUDA else torch.bfloat16
    w13, w2, _, _, logits = _experts(
        tokens, hidden, inter, experts, top_k, dtype, tokens + 70, with_logits=True
    )
    logits = logits.to(dtype)
    weights, chosen = moe_route_ref(logits, top_k, renormalize)
    pending, normed = pending_input(tokens, hidden, dtype, tokens + 71)
    with poisoned():
        routed = moe_gemv_routed_triton(pending, logits, w13, w2, top_k, renormalize)
        given = moe_gemv_triton(pending, w13, w2, weights, chosen)
    # The same experts; the weights from the kernel's softmax, not torch's.
    check(routed.cpu(), given.cpu(), f"routed against given, {tokens} tokens")
    want = _reference(normed.to(dtype), w13, w2, weights, chosen)
    check(routed.to(dtype).cpu(), want.to(dtype), f"routed MoE GEMV {tokens} tokens")


def test_gemv_routes_a_row_of_nan_to_experts_in_range():
    """A graph's padding row has NaN logits: its pairs take the first experts at weight 0,
    in range, and the other rows are untouched."""
    tokens, hidden, inter, experts, top_k = 3, 64, 24, 8, 2
    w13, w2, _, _, logits = _experts(
        tokens, hidden, inter, experts, top_k, torch.float32, 80, with_logits=True
    )
    x = randn(tokens, hidden, g=gen(81), dtype=torch.float32)
    logits[1] = float("nan")
    x[1] = float("nan")
    with poisoned():
        got = moe_gemv_routed_triton(x, logits, w13, w2, top_k, True)
    keep = [0, 2]
    weights, chosen = moe_route_ref(logits[keep], top_k, True)
    want = _reference(x[keep], w13, w2, weights, chosen)
    check(got[keep].cpu(), want, "the rows beside a NaN row")


def test_gemv_equals_the_grouped_gemms():
    """Both paths of the experts give the same function (float32, tokens sharing experts)."""
    tokens, hidden, inter, experts, top_k = 4, 96, 40, 3, 2
    w13, w2, weights, chosen = _experts(tokens, hidden, inter, experts, top_k, torch.float32, 50)
    x = randn(tokens, hidden, g=gen(51), dtype=torch.float32)
    with poisoned():
        gemv = moe_gemv_triton(x, w13, w2, weights, chosen)
        grouped = fused_moe_triton(x, w13, w2, weights, chosen)
    check(gemv.cpu(), grouped.float().cpu(), "GEMV against grouped GEMMs")


def test_settings(monkeypatch):
    assert gemv_max_tokens() >= 1
    monkeypatch.setenv("PEGAINFER_MOE_GEMV_TOKENS", "0")
    assert gemv_max_tokens() == 0
    monkeypatch.setenv("PEGAINFER_MOE_GEMV_TILES", "4,256,4,2/8,128,2,1")
    gate_up, down = tiles_now()
    assert (gate_up.block_n, gate_up.block_k, gate_up.num_warps, gate_up.num_stages) == (
        4,
        256,
        4,
        2,
    )
    assert (down.block_n, down.block_k, down.num_warps, down.num_stages) == (8, 128, 2, 1)


@gpu_only
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_gemv_in_a_cuda_graph_equals_eager(tokens):
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    dtype = torch.bfloat16
    w13, w2, weights, chosen = _experts(tokens, hidden, inter, experts, top_k, dtype, 60)
    pending, _ = pending_input(tokens, hidden, dtype, 61)
    residual = randn(tokens, hidden, g=gen(62), dtype=dtype)
    norm_weight = torch.ones(hidden, dtype=dtype, device=DEVICE)

    logits = randn(tokens, experts, g=gen(63), dtype=dtype)

    def run():
        out = moe_gemv_triton(pending, w13, w2, weights, chosen, residual, norm_weight, 1e-6)
        routed = moe_gemv_routed_triton(
            pending, logits, w13, w2, top_k, True, residual, norm_weight, 1e-6
        )
        return out.hidden, out.weighted, out.square_sums, routed.hidden, routed.square_sums

    eager = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for out in captured:
        out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager):
        assert torch.equal(got, want), f"{tokens} tokens (seed {SEED})"


@pytest.mark.skipif(CUDA, reason="on a GPU the golden tests run these kernels in the model")
def test_tiny_qwen3_moe_runs_the_same_on_triton_kernels(tmp_path, monkeypatch):
    """The sparse MLP's kernels in the real model (decode steps of one and two sequences on
    the GEMVs, prefill chunks on the grouped GEMMs), against the references: the same
    greedy tokens."""
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from worker_helpers import MiniScheduler, engine_config, make_tiny_checkpoint

    import kernels.sparse_mlp as sparse_mlp
    from pegainfer.protocol import SamplingParams
    from worker_proc.model_runner import ModelRunner

    runner = ModelRunner(engine_config(make_tiny_checkpoint(str(tmp_path), "qwen3_moe", seed=2)))

    def generate() -> dict[int, list[int]]:
        scheduler = MiniScheduler(runner, chunk=5, token_budget=8, seed=3)
        for seq_id, tokens in enumerate([list(range(40, 49)), [77, 3]]):
            scheduler.add(seq_id, tokens, 4, SamplingParams(temperature=0.0))
        outputs = scheduler.run()
        scheduler.flush()
        return outputs

    expected = generate()
    monkeypatch.setattr(sparse_mlp, "use_triton", lambda tensor: True)
    assert generate() == expected, f"seed {SEED}"
