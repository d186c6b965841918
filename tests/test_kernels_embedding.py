"""The embedding lookup kernel against its reference: whole and partial feature tiles, ids
of a tensor-parallel rank's range and outside it (zeros), and a 2-D batch of ids; the lookup
fused with the first layer's RMSNorm (kernels/rmsnorm.py)."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, check, gen, poisoned, randn, requires_triton

from kernels.embedding import embedding, embedding_ref, embedding_triton
from kernels.rmsnorm import embed_rms_norm, embed_rms_norm_triton, rms_norm_ref, rms_norm_triton

pytestmark = requires_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200] + ([2560, 4096] if CUDA else []))
def test_embedding_matches_reference(dtype, hidden):
    weight = randn(300, hidden, g=gen(1), dtype=dtype)
    ids = torch.randint(0, 300, (9,), generator=gen(2)).to(DEVICE)
    with poisoned():
        out = embedding_triton(ids, weight)
    assert torch.equal(out, embedding_ref(ids, weight)), f"seed {SEED}"
    assert torch.equal(out, weight[ids])


def test_rank_range_gives_zeros_outside():
    weight = randn(100, 48, g=gen(3), dtype=torch.float32)  # ids 200 .. 299 on this rank
    ids = torch.tensor([[200, 5, 299], [300, 250, 199]], device=DEVICE)
    with poisoned():
        out = embedding_triton(ids, weight, vocab_start=200)
    assert out.shape == (2, 3, 48)
    assert torch.equal(out, embedding_ref(ids, weight, vocab_start=200))
    assert torch.equal(out[0, 0], weight[0]) and torch.equal(out[1, 1], weight[50])
    for row, col in ((0, 1), (1, 0), (1, 2)):
        assert not out[row, col].any()


def test_dispatch_runs_the_reference_on_cpu():
    weight = torch.randn(10, 8)
    ids = torch.tensor([3, 9, 0])
    assert torch.equal(embedding(ids, weight), weight[ids])
    assert not embedding(torch.tensor([12]), weight).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 200] + ([2560, 4096] if CUDA else []))
def test_embedding_with_the_first_norm_matches_lookup_then_norm(dtype, hidden):
    """The lookup fused with the first layer's norm: the rows are the table's, and the norm is
    the bits of the norm kernel run on them (as the unfused pair gives), within tolerance of
    the reference; an id outside the table gives zeros, a 2-D batch keeps its shape."""
    table = randn(300, hidden, g=gen(4), dtype=dtype)
    norm_weight = 1.0 + randn(hidden, g=gen(5), dtype=dtype, scale=0.1)
    ids = torch.randint(0, 300, (2, 5), generator=gen(6)).to(DEVICE)
    ids[1, 3] = 300
    with poisoned():
        normed, rows = embed_rms_norm_triton(ids, table, norm_weight, 1e-6)
    expected_rows = embedding_ref(ids, table)
    assert rows.shape == normed.shape == (2, 5, hidden)
    assert torch.equal(rows, expected_rows), f"seed {SEED}"
    assert not rows[1, 3].any() and not normed[1, 3].any()
    known = ids.view(-1) < 300
    unfused = rms_norm_triton(table[ids.view(-1)[known]], norm_weight, 1e-6)
    assert torch.equal(normed.view(-1, hidden)[known], unfused)
    check(normed, rms_norm_ref(expected_rows, norm_weight, 1e-6), "embedding + norm")
    ref_normed, ref_rows = embed_rms_norm(ids.cpu(), table.cpu(), norm_weight.cpu(), 1e-6)
    assert torch.equal(ref_rows, expected_rows.cpu())
    check(normed.cpu(), ref_normed, "dispatch on the CPU")
