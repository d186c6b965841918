"""Mixture-of-experts routing and grouping (kernels/moe_routing.py, moe_grouping.py,
moe_route_group.py) against their references, and the references against the plain
definition: each token's top-k experts by softmax probability, its pairs laid out expert by
expert. Fresh random inputs each run (seed in messages).
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
    requires_triton,
)

from kernels.moe_grouping import max_padded_rows, moe_group_ref, moe_group_triton
from kernels.moe_route_group import (
    FUSED_ROUTING_MAX_TOKENS,
    moe_route_and_group_ref,
    moe_route_and_group_triton,
    pairs_in_registers,
)
from kernels.moe_routing import moe_route, moe_route_ref, moe_route_triton

# (tokens, experts, top_k): one decode row, a few rows, rows sharing few experts, more
# pairs than a grouping chunk, and on a GPU Qwen3-30B-A3B's router at batch 64 and a prefill.
ROUTING_SHAPES = [(1, 8, 2), (5, 8, 2), (9, 4, 4), (37, 16, 3), (64, 128, 8), (70, 128, 8)] + (
    [(8, 128, 8), (1000, 128, 8)] if CUDA else []
)


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_reference_is_softmax_top_k(renormalize):
    logits = distinct_logits(6, 10, 1)
    weights, experts = moe_route_ref(logits, 3, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    for t in range(6):
        want = sorted(range(10), key=lambda e: -probs[t, e].item())[:3]
        assert experts[t].tolist() == want
        chosen = probs[t, want]
        expect = chosen / chosen.sum() if renormalize else chosen
        torch.testing.assert_close(weights[t], expect)


@requires_triton
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", ROUTING_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_kernel_matches_reference(tokens, experts, top_k, renormalize, dtype):
    logits = distinct_logits(tokens, experts, tokens + experts).to(dtype)
    with poisoned():
        weights, chosen = moe_route_triton(logits, top_k, renormalize)
    want_weights, want_experts = moe_route_ref(logits, top_k, renormalize)
    assert torch.equal(chosen.cpu(), want_experts.cpu()), f"seed {SEED}"
    check(weights, want_weights, f"routing weights {tokens}x{experts} top {top_k}")


@requires_triton
@pytest.mark.parametrize("tokens", [3, 70])
def test_rows_of_nan_route_to_experts_in_range(tokens):
    """A padding row of a decode graph attends to nothing and its router logits are NaN: it
    must still name real experts (the grouping places pairs by expert id), at weight 0."""
    logits = distinct_logits(tokens, 16, tokens)
    logits[1] = float("nan")
    weights, chosen, groups = moe_route_and_group_triton(logits, 4, True, 16)
    assert chosen.min().item() >= 0 and chosen.max().item() < 16
    assert chosen[1].tolist() == [0, 1, 2, 3] and weights[1].abs().sum().item() == 0
    want_weights, want_experts = moe_route_ref(logits[[0, 2]], 4, True)
    assert torch.equal(chosen[[0, 2]].cpu(), want_experts.cpu())
    placed = groups.sorted_pairs[groups.sorted_pairs < tokens * 4]
    assert sorted(placed.tolist()) == list(range(tokens * 4))


def test_route_rejects_more_experts_than_exist():
    with pytest.raises(ValueError, match="top_k 5 exceeds the 4 experts"):
        moe_route(torch.zeros(2, 4, device=DEVICE), 5, True)


def _random_experts(tokens: int, experts: int, top_k: int, offset: int) -> torch.Tensor:
    g = gen(offset)
    rows = [torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_group_reference_layout(block_m):
    experts = _random_experts(11, 6, 3, block_m)
    groups = moe_group_ref(experts, 6, block_m)
    num_pairs = experts.numel()
    flat = experts.reshape(-1).tolist()
    num_padded = int(groups.num_padded.item())
    assert num_padded % block_m == 0
    assert groups.sorted_pairs.numel() == max_padded_rows(num_pairs, 6, block_m)
    rows = groups.sorted_pairs.tolist()
    # Every pair exactly once, in its expert's blocks, in rising order within the expert.
    assert sorted(r for r in rows if r < num_pairs) == list(range(num_pairs))
    assert all(r == num_pairs for r in rows[num_padded:])
    for block, owner in enumerate(groups.block_expert.tolist()):
        chunk = rows[block * block_m : (block + 1) * block_m]
        if block * block_m >= num_padded:
            assert owner == -1
            continue
        real = [p for p in chunk if p < num_pairs]
        assert real, "a used block holds at least one pair"
        assert all(flat[p] == owner for p in real)
    for expert in range(6):
        mine = [r for r in rows if r < num_pairs and flat[r] == expert]
        assert mine == sorted(mine)


@requires_triton
@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("tokens,experts,top_k", ROUTING_SHAPES)
def test_group_kernel_matches_reference(tokens, experts, top_k, block_m):
    chosen = _random_experts(tokens, experts, top_k, tokens * 7 + block_m)
    with poisoned():
        got = moe_group_triton(chosen, experts, block_m)
    want = moe_group_ref(chosen, experts, block_m)
    _check_same_groups(got, want, f"{tokens}x{experts} top {top_k} block {block_m}")


def _check_same_groups(got, want, what: str) -> None:
    """Same runs, same padding, and each expert's run holds the same pairs (on a GPU they
    land in their run in the order of the atomics that place them)."""
    what = f"{what} (seed {SEED})"
    assert torch.equal(got.num_padded.cpu(), want.num_padded.cpu()), what
    assert torch.equal(got.block_expert.cpu(), want.block_expert.cpu()), what
    block_m = want.block_m
    owners = want.block_expert.cpu().repeat_interleave(block_m)
    got_rows, want_rows = got.sorted_pairs.cpu(), want.sorted_pairs.cpu()
    assert torch.equal(got_rows[owners < 0], want_rows[owners < 0]), what
    for expert in owners.unique().tolist():
        run = owners == expert
        assert torch.equal(got_rows[run].sort().values, want_rows[run].sort().values), what


@requires_triton
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", ROUTING_SHAPES)
def test_route_and_group_matches_reference(tokens, experts, top_k, renormalize):
    # Up to FUSED_ROUTING_MAX_TOKENS tokens one kernel does both, above two.
    assert any(t <= FUSED_ROUTING_MAX_TOKENS for t, _, _ in ROUTING_SHAPES)
    assert any(t > FUSED_ROUTING_MAX_TOKENS for t, _, _ in ROUTING_SHAPES)
    logits = distinct_logits(tokens, experts, 3 * tokens + experts)
    with poisoned():
        weights, chosen, groups = moe_route_and_group_triton(logits, top_k, renormalize, 16)
    want_weights, want_experts, want = moe_route_and_group_ref(logits, top_k, renormalize, 16)
    what = f"{tokens}x{experts} top {top_k}"
    assert torch.equal(chosen.cpu(), want_experts.cpu()), f"{what} (seed {SEED})"
    check(weights, want_weights, f"routing weights {what}")
    _check_same_groups(groups, want, what)


def test_decode_batches_route_and_group_in_registers(monkeypatch):
    # Qwen3-30B-A3B's top 8: one to eight decode rows; more pairs go through memory.
    assert all(pairs_in_registers(tokens, 8) for tokens in range(1, 9))
    assert not pairs_in_registers(9, 8) and not pairs_in_registers(0, 8)
    assert pairs_in_registers(21, 3) and not pairs_in_registers(22, 3)
    monkeypatch.setenv("PEGAINFER_MOE_REGISTER_PAIRS", "0")
    assert not pairs_in_registers(1, 8)


@requires_triton
@pytest.mark.parametrize("block_m", [16, 4])
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (3, 128, 8), (8, 128, 8), (7, 6, 3)])
def test_register_grouping_is_the_reference_layout(tokens, experts, top_k, block_m, monkeypatch):
    """In registers each expert's pairs come in rising order, so the layout is the
    reference's row for row; through memory (the atomics' order) only run for run. Both
    route alike."""
    logits = distinct_logits(tokens, experts, 11 * tokens + experts + block_m)
    assert pairs_in_registers(tokens, top_k)
    with poisoned():
        weights, chosen, groups = moe_route_and_group_triton(logits, top_k, True, block_m)
    want_weights, want_experts, want = moe_route_and_group_ref(logits, top_k, True, block_m)
    what = f"{tokens}x{experts} top {top_k} block {block_m} (seed {SEED})"
    assert torch.equal(chosen.cpu(), want_experts.cpu()), what
    check(weights, want_weights, f"routing weights {what}")
    assert torch.equal(groups.num_padded.cpu(), want.num_padded.cpu()), what
    assert torch.equal(groups.block_expert.cpu(), want.block_expert.cpu()), what
    assert torch.equal(groups.sorted_pairs.cpu(), want.sorted_pairs.cpu()), what
    monkeypatch.setenv("PEGAINFER_MOE_REGISTER_PAIRS", "0")
    with poisoned():
        weights, chosen, through_memory = moe_route_and_group_triton(logits, top_k, True, block_m)
    assert torch.equal(chosen.cpu(), want_experts.cpu()), what
    _check_same_groups(through_memory, want, what)


@requires_triton
def test_register_routing_shares_experts_between_tokens():
    """Tokens that pick the same experts share their runs: counts above one a run, runs
    longer than a block."""
    logits = distinct_logits(1, 16, 5).repeat(8, 1)
    logits[5] = distinct_logits(1, 16, 6)[0]
    with poisoned():
        weights, chosen, groups = moe_route_and_group_triton(logits, 4, False, 4)
    want_weights, want_experts, want = moe_route_and_group_ref(logits, 4, False, 4)
    assert torch.equal(chosen.cpu(), want_experts.cpu())
    check(weights, want_weights, "routing weights of repeated rows")
    assert torch.equal(groups.sorted_pairs.cpu(), want.sorted_pairs.cpu())
    assert torch.equal(groups.block_expert.cpu(), want.block_expert.cpu())
    assert torch.equal(groups.num_padded.cpu(), want.num_padded.cpu())
