"""The router ending in its routing and grouping (kernels/moe_router_route.py) against the
reference: the router's projection (its pending input norm applied), softmax top-k, and the
pairs laid out expert by expert; and the sparse layer that runs it against the one that
takes the router's logits. Fresh random inputs each run (seed in messages).
"""

from __future__ import annotations

import pytest
import torch
from triton_test_util import (
    CUDA,
    DEVICE,
    SEED,
    check,
    distinct_logits,
    gen,
    poisoned,
    randn,
    requires_triton,
)

from kernels.linear import linear
from kernels.moe_grouping import moe_group_ref
from kernels.moe_route_group import moe_route_and_group_ref
from kernels.moe_router_route import (
    router_fused,
    router_route_and_group_ref,
    router_route_and_group_triton,
    router_tile_k,
)
from kernels.pending_norm import PendingNorm

# (tokens, experts, top_k, hidden): one decode row, a few rows, the most pairs one program
# takes (64), hidden sizes that leave a partial K tile; on a GPU Qwen3-30B-A3B's router at
# 1-8 decode rows and Qwen3-235B-A22B's at 4.
SHAPES = [(1, 16, 4, 48), (3, 6, 3, 100), (8, 16, 8, 64), (2, 8, 2, 300)] + (
    [(1, 128, 8, 2048), (2, 128, 8, 2048), (5, 128, 8, 2048), (8, 128, 8, 2048)]
    + [(4, 128, 8, 4096)]
    if CUDA
    else []
)


def pending(hidden_rows: torch.Tensor, norm_weight: torch.Tensor, groups: int) -> PendingNorm:
    """``hidden_rows`` with its norm pending, as a producing projection leaves it: the
    weighted stream, and each row's sum of squares spread over ``groups`` slots."""
    stream = hidden_rows.float()
    weighted = (stream * norm_weight.float()).to(hidden_rows.dtype)
    parts = (stream * stream).reshape(stream.shape[0], groups, -1).sum(dim=2)
    return PendingNorm(hidden_rows, norm_weight, 1e-6, parts.contiguous(), weighted)


def exact_logits(x, router_weight: torch.Tensor) -> torch.Tensor:
    """Float64 logits as the kernel defines them: ``weighted @ W.T`` scaled by each row's
    ``1 / rms`` for a pending norm, as the router's GEMV applies it."""
    if not isinstance(x, PendingNorm):
        return x.double() @ router_weight.double().T
    hidden = x.hidden.double()
    inverse_rms = 1.0 / torch.sqrt((hidden * hidden).mean(dim=1, keepdim=True) + x.eps)
    return (x.weighted.double() @ router_weight.double().T) * inverse_rms


def logits_as_the_kernel_takes_them(x, router_weight: torch.Tensor) -> torch.Tensor:
    """``exact_logits`` rounded to the input's dtype, as the kernel stores them."""
    dtype = x.hidden.dtype if isinstance(x, PendingNorm) else x.dtype
    return exact_logits(x, router_weight).to(dtype)


def one_hot_inputs(tokens, experts, hidden, dtype, offset, scale=1.0):
    """Inputs whose logits are ``distinct_logits`` times ``scale``: token t is feature t's
    unit vector, and the router's column t holds the token's logits."""
    assert hidden >= tokens
    x = torch.zeros(tokens, hidden, dtype=dtype, device=DEVICE)
    x[torch.arange(tokens), torch.arange(tokens)] = 1.0
    router_weight = torch.zeros(experts, hidden, dtype=dtype, device=DEVICE)
    router_weight[:, :tokens] = (distinct_logits(tokens, experts, offset).T * scale).to(dtype)
    return x, router_weight


def assert_top_k_within(chosen: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """Each row's experts are a top-k of the ``exact`` logits, in order, to within the
    rounding of 16-bit logits (2**-7 of the row's largest)."""
    exact = exact.double().cpu()
    slack = exact.abs().amax(dim=1) * 2.0**-7
    for t in range(exact.shape[0]):
        picked = exact[t, chosen[t].long().cpu()]
        others = torch.ones(exact.shape[1], dtype=torch.bool)
        others[chosen[t].long().cpu()] = False
        assert picked.min() >= exact[t, others].max() - slack[t], f"token {t}, {what}"
        assert (picked[1:] <= picked[:-1] + slack[t]).all(), f"token {t} order, {what}"


def _check_layout(groups, want, what: str) -> None:
    assert torch.equal(groups.num_padded.cpu(), want.num_padded.cpu()), what
    assert torch.equal(groups.block_expert.cpu(), want.block_expert.cpu()), what
    assert torch.equal(groups.sorted_pairs.cpu(), want.sorted_pairs.cpu()), what


@requires_triton
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,hidden", SHAPES)
def test_router_routes_and_groups_as_the_reference(
    tokens, experts, top_k, hidden, dtype, normed, renormalize
):
    """Logits with no near ties: the experts and the layout are the reference's exactly.
    Scaled by a pending norm's ``1 / rms``, 16-bit logits may round to a tie or a unit apart
    from the float64 reference's (the interpreter truncates): there the experts are a top-k
    to within that rounding, the layout is the reference's for them, and the weights are
    held loosely."""
    # A one-hot row's norm scales it by about sqrt(hidden): the router's weight is scaled
    # down alike, so that the tail of the top-k keeps probabilities above float32's least.
    scale = hidden**-0.5 if normed else 1.0
    x, router_weight = one_hot_inputs(
        tokens, experts, hidden, dtype, tokens + experts + hidden, scale
    )
    if normed:
        norm_weight = (randn(hidden, g=gen(hidden), dtype=dtype, scale=0.1) + 1.0).abs()
        x = pending(x * 3.0, norm_weight, 4 if hidden % 4 == 0 else 1)
    with poisoned():
        weights, chosen, groups = router_route_and_group_triton(
            x, router_weight, top_k, renormalize, 16
        )
    logits = logits_as_the_kernel_takes_them(x, router_weight)
    want_weights, want_experts, want = moe_route_and_group_ref(logits, top_k, renormalize, 16)
    what = f"{tokens}x{experts} top {top_k}, hidden {hidden}, {dtype}, normed {normed}"
    what += f" (seed {SEED})"
    if normed and dtype != torch.float32:
        assert_top_k_within(chosen, exact_logits(x, router_weight), what)
        torch.testing.assert_close(weights, want_weights, atol=0.05, rtol=0.0, msg=what)
        _check_layout(groups, moe_group_ref(chosen, experts, 16), what)
        return
    assert torch.equal(chosen.cpu(), want_experts.cpu()), what
    check(weights, want_weights, f"routing weights {what}")
    _check_layout(groups, want, what)


@requires_triton
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("tokens,experts,top_k,hidden", SHAPES)
def test_router_of_dense_inputs_matches_the_reference(tokens, experts, top_k, hidden, normed):
    """Random inputs in float32: every feature counts in each logit, and ties are
    improbable, so the routing is the reference's exactly."""
    g = gen(3 * tokens + experts + hidden)
    x = randn(tokens, hidden, g=g, dtype=torch.float32)
    router_weight = randn(experts, hidden, g=g, dtype=torch.float32, scale=hidden**-0.5)
    if normed:
        norm_weight = randn(hidden, g=g, dtype=torch.float32, scale=0.1) + 1.0
        x = pending(x, norm_weight, 2 if hidden % 2 == 0 else 1)
    with poisoned():
        weights, chosen, groups = router_route_and_group_triton(x, router_weight, top_k, True, 16)
    want_weights, want_experts, want = router_route_and_group_ref(x, router_weight, top_k, True, 16)
    what = f"{tokens}x{experts} top {top_k}, hidden {hidden}, normed {normed} (seed {SEED})"
    assert torch.equal(chosen.cpu(), want_experts.cpu()), what
    check(weights, want_weights, f"routing weights {what}")
    _check_layout(groups, want, what)


@requires_triton
def test_router_of_bf16_inputs_picks_a_top_k_of_the_exact_logits():
    """In bfloat16 the kernel's logits are rounded, as the router's GEMV rounds them: each
    token's experts are a top-k of the exact logits to within that rounding, in order."""
    tokens, experts, top_k, hidden = (8, 128, 8, 2048) if CUDA else (8, 16, 8, 96)
    g = gen(77)
    x = randn(tokens, hidden, g=g, dtype=torch.bfloat16)
    router_weight = randn(experts, hidden, g=g, dtype=torch.bfloat16, scale=hidden**-0.5)
    with poisoned():
        _, chosen, groups = router_route_and_group_triton(x, router_weight, top_k, True, 16)
    what = f"bfloat16 (seed {SEED})"
    assert_top_k_within(chosen, x.double() @ router_weight.double().T, what)
    _check_layout(groups, moe_group_ref(chosen, experts, 16), what)


@requires_triton
def test_rows_of_nan_route_to_experts_in_range():
    """A padding row of a decode graph may hold NaN: its pairs still name real experts."""
    x, router_weight = one_hot_inputs(3, 16, 32, torch.float32, 5)
    x[1] = float("nan")
    weights, chosen, groups = router_route_and_group_triton(x, router_weight, 4, True, 16)
    assert chosen.min().item() >= 0 and chosen.max().item() < 16
    assert chosen[1].tolist() == [0, 1, 2, 3] and weights[1].abs().sum().item() == 0
    placed = groups.sorted_pairs[groups.sorted_pairs < 12]
    assert sorted(placed.tolist()) == list(range(12))


@requires_triton
def test_repeated_launches_reset_the_arrival_counter():
    """The last program leaves its counter at zero for the next launch: launches in a row
    (a graph's replays, a step's layers) each route."""
    for offset in range(3):
        x, router_weight = one_hot_inputs(2, 8, 16, torch.float32, 40 + offset)
        _, chosen, _ = router_route_and_group_triton(x, router_weight, 2, True, 16)
        want = moe_route_and_group_ref(x @ router_weight.T, 2, True, 16)[1]
        assert torch.equal(chosen.cpu(), want.cpu()), f"launch {offset} (seed {SEED})"


def test_decode_batches_of_three_to_eight_rows_take_the_fused_router(monkeypatch):
    # Qwen3-30B-A3B's top 8: above 16 pairs, up to the register kernel's 64.
    monkeypatch.delenv("PEGAINFER_MOE_FUSED_ROUTER", raising=False)
    assert [tokens for tokens in range(0, 12) if router_fused(tokens, 8)] == [3, 4, 5, 6, 7, 8]
    monkeypatch.setenv("PEGAINFER_MOE_FUSED_ROUTER", "1")
    assert [tokens for tokens in range(0, 12) if router_fused(tokens, 8)] == list(range(1, 9))
    monkeypatch.setenv("PEGAINFER_MOE_FUSED_ROUTER", "0")
    assert not router_fused(4, 8)
    monkeypatch.setenv("PEGAINFER_MOE_FUSED_ROUTER", "1")
    monkeypatch.setenv("PEGAINFER_MOE_REGISTER_PAIRS", "0")
    assert not router_fused(4, 8)


def test_router_tile_holds_a_bounded_slice_of_the_inputs_a_thread():
    # One row in one warp: Qwen3-30B-A3B's whole 2,048 in one tile; eight rows in four warps
    # 1,024; never wider than the hidden size, never below 64.
    assert router_tile_k(1, 2048, 1) == 2048
    assert router_tile_k(2, 2048, 1) == 1024
    assert router_tile_k(8, 2048, 4) == 1024
    assert router_tile_k(1, 100, 1) == 128
    assert router_tile_k(64, 4096, 1) == 64


def test_too_many_pairs_are_refused(monkeypatch):
    monkeypatch.delenv("PEGAINFER_MOE_FUSED_ROUTER", raising=False)
    x = torch.zeros(9, 8)
    with pytest.raises(ValueError, match="too many pairs"):
        router_route_and_group_triton(x, torch.zeros(16, 8), 8, True, 16)


@requires_triton
@pytest.mark.parametrize("tokens", [1, 6, 9])
def test_sparse_layer_with_its_router_equals_the_layer_given_logits(tokens, monkeypatch):
    """``moe_layer_add_rms_norm`` (the router fused up to 64 pairs, its GEMV above) gives the
    layer's output of ``moe_mlp_add_rms_norm`` given the router GEMV's logits."""
    import kernels.sparse_mlp as sparse_mlp

    monkeypatch.setattr(sparse_mlp, "use_triton", lambda t: True)
    monkeypatch.delenv("PEGAINFER_MOE_FUSED_ROUTER", raising=False)
    hidden, inter, experts, top_k = (2048, 768, 128, 8) if CUDA else (64, 16, 16, 8)
    dtype = torch.bfloat16 if CUDA else torch.float16
    g = gen(tokens + 90)
    x, router_weight = one_hot_inputs(tokens, experts, hidden, dtype, tokens + 91)
    norm_weight = (randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0).abs()
    stream = x * 2.0 + randn(tokens, hidden, g=g, dtype=dtype, scale=1e-3)
    x = pending(stream, norm_weight, 4)
    w13 = randn(experts, 2 * inter, hidden, g=g, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, g=g, dtype=dtype, scale=inter**-0.5)
    residual = randn(tokens, hidden, g=g, dtype=dtype)
    out_norm = randn(hidden, g=g, dtype=dtype, scale=0.1) + 1.0
    args = (w13, w2, top_k, True, residual, out_norm, 1e-6)
    with poisoned():
        got, got_residual = sparse_mlp.moe_layer_add_rms_norm(x, router_weight, *args)
        want, want_residual = sparse_mlp.moe_mlp_add_rms_norm(x, linear(x, router_weight), *args)
    what = f"{tokens} tokens (seed {SEED})"
    assert router_fused(tokens, top_k) == (3 <= tokens <= 8)
    check(got_residual, want_residual, f"residual, {what}")
    got = got.materialize() if isinstance(got, PendingNorm) else got
    want = want.materialize() if isinstance(want, PendingNorm) else want
    check(got, want, f"normed output, {what}")
