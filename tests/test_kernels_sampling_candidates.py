"""The candidates kernel (top-k, top-p and min-p cuts, then the race) against its torch
reference: random rows under every combination of cuts, seeded and unseeded; cut ranks never
drawn; and the draws' frequencies those of the cut, renormalised distribution."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, poisoned, requires_triton

from kernels.sampling_candidates import (
    race_candidates,
    race_candidates_ref,
    race_candidates_triton,
)

pytestmark = [requires_triton, pytest.mark.filterwarnings("ignore:overflow encountered")]


def _candidates(rows: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, 5000, generator=g) * 2
    values, ids = scores.topk(width, dim=-1)
    return values.to(DEVICE), ids.to(DEVICE)


def _settings(rows: int, width: int, seed: int):
    g = torch.Generator().manual_seed(seed + 1)
    top_k = torch.randint(1, width + 1, (rows,), generator=g).to(DEVICE)
    top_p = (0.3 + 0.7 * torch.rand(rows, generator=g)).to(DEVICE)
    top_p[::3] = 2.0  # off in some rows of a batch that cuts by it
    min_p = (0.2 * torch.rand(rows, generator=g)).to(DEVICE)
    keys = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64).to(DEVICE)
    keys[1::2] = -1  # unseeded
    positions = torch.randint(0, 2**40, (rows,), generator=g, dtype=torch.int64).to(DEVICE)
    return top_k, top_p, min_p, keys, positions


@pytest.mark.parametrize("width", [7, 32, 128])
@pytest.mark.parametrize("cuts", ["top_k", "top_p", "min_p", "both"])
def test_candidates_match_the_reference(width, cuts):
    rows = 16
    values, ids = _candidates(rows, width, SEED)
    top_k, top_p, min_p, keys, positions = _settings(rows, width, SEED)
    top_p = top_p if cuts in ("top_p", "both") else None
    min_p = min_p if cuts in ("min_p", "both") else None
    call_key = SEED % 2**31
    args = (values, ids, top_k, top_p, min_p, keys, positions, call_key)
    with poisoned():
        drawn = race_candidates_triton(*args)
    expected = race_candidates_ref(*args)
    assert drawn.dtype == torch.int64
    # On a GPU a softmax summed in another order, or its exp and log, may move a cut or a
    # near-tie by an ulp; the interpreter's float32 agrees with torch's.
    assert (drawn == expected).float().mean().item() >= (0.9 if CUDA else 1.0), f"seed {SEED}"
    # Every draw is one of the row's first top_k candidates.
    for row in range(rows):
        allowed = ids[row, : int(top_k[row])].tolist()
        assert int(drawn[row]) in allowed, f"seed {SEED}"


def test_candidates_follow_the_cut_distribution():
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    n = 3000
    values = probs.log().expand(n, -1).contiguous().to(DEVICE)
    ids = (torch.arange(8) * 11 + 5).expand(n, -1).contiguous().to(DEVICE)
    top_k = torch.full((n,), 5, device=DEVICE)
    top_p = torch.full((n,), 0.7, device=DEVICE)
    keys = torch.full((n,), -1, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(n, device=DEVICE)
    drawn = race_candidates(values, ids, top_k, top_p, None, keys, positions, 77).cpu()
    # top_k 5 renormalises to [0.353, 0.235, 0.176, 0.118, 0.118]; top_p 0.7 keeps three.
    kept = probs[:3] / probs[:3].sum()
    freq = torch.stack([(drawn == 5 + 11 * i).double().mean() for i in range(8)])
    assert freq[3:].sum() == 0
    assert torch.allclose(freq[:3], kept.double(), atol=0.03), freq.tolist()


def test_dispatch_checks_shapes():
    values = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="alike"):
        race_candidates(values, torch.zeros(2, 3, dtype=torch.long), torch.ones(2), None, None,
                        torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))  # fmt: skip
