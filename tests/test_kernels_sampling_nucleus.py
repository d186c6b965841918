"""The sort-free top-p / min-p draw: its reference against the sorted cut it replaces (the
kept set, then the race over it), and the kernel against its reference, for random rows
over several chunks in both dtypes; rows of -inf, +inf and NaN; a row's draw fixed by its
own key, position, values and settings."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, gen, poisoned, randn, requires_triton

from kernels.sampling_nucleus import (
    ROUNDS,
    TOP_P_OFF,
    race_nucleus,
    race_nucleus_ref,
    race_nucleus_triton,
)
from kernels.sampling_race import race_rows_ref

pytestmark = [
    requires_triton,
    # The interpreter's numpy: log(0) of a min-p that is off, exp(-inf) of cut tokens.
    pytest.mark.filterwarnings("ignore:overflow encountered"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered"),
    pytest.mark.filterwarnings("ignore:invalid value encountered"),
]

# Small chunks on the CPU interpreter, so that a short row still spans several chunks.
CHUNK = 2048 if CUDA else 64


def settings(rows: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Per-row inverse temperature, top-p (some off), min-p (some off), key (some unseeded)
    and position."""
    g = torch.Generator().manual_seed(seed)
    inv_temperature = 1.0 / (0.3 + 1.5 * torch.rand(rows, generator=g))
    top_p = 0.05 + 0.94 * torch.rand(rows, generator=g)
    top_p[1::3] = TOP_P_OFF
    min_p = torch.where(
        torch.rand(rows, generator=g) < 0.5, 0.0, 0.3 * torch.rand(rows, generator=g)
    )
    min_p[1::3] = torch.where(min_p[1::3] > 0, min_p[1::3], 0.1)  # no row without a cut
    keys = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64)
    keys[::2] = -1
    positions = torch.randint(0, 2**40, (rows,), generator=g, dtype=torch.int64)
    tensors = (inv_temperature, top_p, min_p, keys, positions)
    return tuple(t.to(DEVICE) for t in tensors)


def sorted_cut(values, inv_temperature, top_p, min_p) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept set the sorted path keeps, and each row's distance of its cuts from rounding
    (large: no near-tie): the mass before each token minus top-p, a sum of many terms whose
    rounding is absolute; and each token's probability over the first's against min-p,
    relative, as a quotient's rounding is. A cut that is off has no bound to tie with: a row
    without min-p would otherwise count its tail's tiny ratios as near-ties."""
    scores = values.float() * inv_temperature.unsqueeze(1)
    ordered, order = scores.sort(dim=1, descending=True)
    probs = ordered.softmax(dim=1)
    before = probs.cumsum(dim=1) - probs
    keep_sorted = before <= top_p.unsqueeze(1)
    keep_sorted &= probs >= min_p.unsqueeze(1) * probs[:, :1]
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    top_p_margin = (before - top_p.unsqueeze(1)).abs().amin(dim=1)
    ratio = probs / probs[:, :1]
    min_p_margin = (ratio / min_p.unsqueeze(1) - 1.0).abs().amin(dim=1)
    off = torch.full_like(top_p_margin, float("inf"))
    top_p_margin = torch.where(top_p < 1.0, top_p_margin, off)
    min_p_margin = torch.where(min_p > 0.0, min_p_margin, off)
    return keep, torch.minimum(top_p_margin, min_p_margin)


@pytest.mark.parametrize("rows, vocab, scale", [(12, 3000, 2.0), (9, 1500, 6.0), (6, 4000, 0.5)])
def test_the_reference_draws_what_the_sorted_cut_and_race_draw(rows, vocab, scale):
    values = randn(rows, vocab, g=gen(3), dtype=torch.float32, scale=scale)
    inv_temperature, top_p, min_p, keys, positions = settings(rows, SEED)
    keep, margin = sorted_cut(values, inv_temperature, top_p, min_p)
    scores = (values * inv_temperature.unsqueeze(1)).masked_fill(~keep, float("-inf"))
    ones = torch.ones_like(inv_temperature)
    for call_key in (0, SEED % 2**31):
        expected = race_rows_ref(scores, ones, keys, positions, call_key)
        drawn = race_nucleus_ref(values, inv_temperature, top_p, min_p, keys, positions, call_key)
        clear = margin > 1e-5  # rows whose cut no float rounding can move
        assert clear.sum() >= rows // 2, f"seed {SEED}"
        assert torch.equal(drawn[clear], expected[clear]), f"seed {SEED}"
        assert keep.gather(1, drawn.unsqueeze(1)).all(), f"seed {SEED}: a cut token drawn"


def run(values, inv_temperature, top_p, min_p, keys, positions, call_key: int = 0, rounds=None):
    with poisoned():
        return race_nucleus_triton(
            values, inv_temperature, top_p, min_p, keys, positions, call_key, chunk=CHUNK,
            rounds=ROUNDS if rounds is None else rounds,
        )  # fmt: skip


# rounds: 0 leaves every row's search to its one program after the first pass; 1 most rows.
@pytest.mark.parametrize("rounds", [0, 1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, vocab", [(1, 50), (5, 1000), (7, 64 * 9)] + ([(8, 151936), (64, 151936)] if CUDA else [])
)
def test_the_kernel_matches_the_reference(dtype, rows, vocab, rounds):
    values = randn(rows, vocab, g=gen(4), dtype=dtype, scale=3.0)
    inv_temperature, top_p, min_p, keys, positions = settings(rows, SEED + 1)
    call_key = SEED % 2**31
    tokens = run(values, inv_temperature, top_p, min_p, keys, positions, call_key, rounds)
    expected = race_nucleus_ref(values, inv_temperature, top_p, min_p, keys, positions, call_key)
    assert tokens.dtype == torch.int64
    # The kernel's sums and logs may round apart from torch's: only a near-tie could differ.
    agree = (tokens == expected).float().mean().item()
    assert agree >= (0.95 if rows >= 8 else 1.0), f"seed {SEED}: {agree:.3f}"


def test_rows_of_inf_nan_and_every_token_cut():
    vocab = 5 * CHUNK + 3
    values = torch.randn(4, vocab, generator=gen(5)).to(DEVICE)
    values[0] = float("-inf")  # every token cut before (bans, a grammar): column 0, as the race
    values[1, 7] = float("inf")
    values[2, CHUNK + 2] = float("nan")  # NaN counts as +inf, as in the race
    values[3, :] = float("-inf")
    values[3, [5, 3 * CHUNK]] = 1.0  # two equal survivors
    inv_temperature, top_p, min_p, keys, positions = settings(4, SEED + 2)
    top_p[:] = 0.5
    ref = race_nucleus_ref(values, inv_temperature, top_p, min_p, keys, positions).tolist()
    for rounds in (0, 1, ROUNDS):
        tokens = run(values, inv_temperature, top_p, min_p, keys, positions, rounds=rounds)
        tokens = tokens.tolist()
        assert tokens[:3] == [0, 7, CHUNK + 2], f"seed {SEED}"
        assert tokens[3] in (5, 3 * CHUNK), f"seed {SEED}"
        assert ref == tokens


def test_a_rows_draw_depends_on_its_own_settings_only():
    rows, vocab = 4, 6 * CHUNK
    values = randn(rows, vocab, g=gen(6), dtype=torch.float32, scale=2.0)
    inv_temperature, top_p, min_p, keys, positions = settings(rows, SEED + 3)
    keys[::2] = torch.arange(0, rows, 2) + 99  # seeded: an unseeded row's key is its index's
    together = run(values, inv_temperature, top_p, min_p, keys, positions)
    for row in range(rows):
        one = slice(row, row + 1)
        alone = run(values[one], inv_temperature[one], top_p[one], min_p[one], keys[one],
                    positions[one])  # fmt: skip
        assert alone.item() == together[row].item(), f"seed {SEED}"


def test_draws_follow_the_cut_softmax():
    """Top-p 0.7 over (0.4, 0.25, 0.2, 0.1, 0.05) keeps the first three (mass before them 0,
    0.4, 0.65); min-p 0.3 then cuts nothing more. Their renormalised frequencies hold."""
    probs = torch.tensor([0.25, 0.4, 0.05, 0.2, 0.1])
    n = 3000
    values = probs.log().expand(n, -1).contiguous().to(DEVICE)
    ones = torch.ones(n, device=DEVICE)
    top_p = torch.full((n,), 0.7, device=DEVICE)
    min_p = torch.full((n,), 0.3, device=DEVICE)
    keys = torch.full((n,), 12345, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(n, dtype=torch.int64, device=DEVICE)
    tokens = race_nucleus(values, ones, top_p, min_p, keys, positions).cpu()
    counts = torch.bincount(tokens, minlength=5).float() / n
    expected = torch.tensor([0.25, 0.4, 0.0, 0.2, 0.0]) / 0.85
    assert (counts - expected).abs().max().item() < 0.04, counts
