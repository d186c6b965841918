"""The embedding lookup kernel against its reference: whole and partial feature tiles, ids
of a tensor-parallel rank's range and outside it (zeros), and a 2-D batch of ids."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, gen, poisoned, randn, requires_triton

from kernels.embedding import embedding, embedding_ref, embedding_triton

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
