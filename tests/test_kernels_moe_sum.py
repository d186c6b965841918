"""The experts' sum (kernels/moe_sum.py) and the sparse MLP around it (kernels/sparse_mlp.py)
against their references: the weighted sum with the residual add and the norm, whole or left
pending in slices. The grouped GEMMs are tests/test_kernels_fused_moe.py's. Fresh random
inputs each run (seed in messages).
"""

from __future__ import annotations

import pytest
import torch
from triton_test_util import (
    CUDA,
    DEVICE,
    check,
    distinct_logits,
    gen,
    poisoned,
    randn,
    requires_triton,
)

from kernels.fused_moe import fused_moe_ref
from kernels.moe_routing import moe_route_ref
from kernels.moe_sum import (
    SLICE_FEATURES,
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
