"""The Gumbel-max race kernel against its reference: the same draws for random rows across
several chunks, in both dtypes; -inf entries never drawn; a row's draw fixed by its key,
position and values alone; and draws that follow the softmax."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, gen, poisoned, randn, requires_triton

from kernels.sampling_race import race_rows, race_rows_ref, race_rows_triton

pytestmark = [requires_triton, pytest.mark.filterwarnings("ignore:overflow encountered")]

# Small chunks on the CPU interpreter, so that a short row still spans several programs.
CHUNK = 4096 if CUDA else 64


def _inputs(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    inv_temperature = (1.0 / (0.3 + 1.5 * torch.rand(rows, generator=g))).to(DEVICE)
    keys = torch.randint(0, 2**32, (rows,), generator=g, dtype=torch.int64).to(DEVICE)
    positions = torch.randint(0, 2**40, (rows,), generator=g, dtype=torch.int64).to(DEVICE)
    return inv_temperature, keys, positions


def run(values, inv_temperature, keys, positions, call_key: int = 0) -> torch.Tensor:
    with poisoned():
        return race_rows_triton(values, inv_temperature, keys, positions, call_key, chunk=CHUNK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, vocab", [(1, 50), (4, 1000), (6, 64 * 7)] + ([(8, 151936), (64, 151936)] if CUDA else [])
)
def test_race_matches_the_reference(dtype, rows, vocab):
    values = randn(rows, vocab, g=gen(1), dtype=dtype, scale=3.0)
    inv_temperature, keys, positions = _inputs(rows, SEED)
    keys[::2] = -1  # unseeded rows: keys of the call and the row
    call_key = SEED % 2**31
    tokens = run(values, inv_temperature, keys, positions, call_key)
    expected = race_rows_ref(values, inv_temperature, keys, positions, call_key)
    assert tokens.dtype == torch.int64
    # The kernel's log may round apart from torch's by an ulp: only a near-tie could differ.
    assert (tokens == expected).float().mean().item() >= (0.95 if rows >= 8 else 1.0), (
        f"seed {SEED}"
    )


def test_masked_entries_are_never_drawn():
    rows, vocab = 3, 9 * CHUNK + 5
    values = torch.full((rows, vocab), float("-inf"), device=DEVICE)
    allowed = [[3, CHUNK + 1, 8 * CHUNK], [vocab - 1], [0, 2 * CHUNK]]
    for row, columns in enumerate(allowed):
        values[row, columns] = 0.0
    for position in range(12):
        inv_temperature, keys, _ = _inputs(rows, position)
        positions = torch.full((rows,), position, dtype=torch.int64, device=DEVICE)
        tokens = run(values, inv_temperature, keys, positions).tolist()
        assert all(t in a for t, a in zip(tokens, allowed)), f"seed {SEED}"


def test_a_rows_draw_depends_on_its_key_position_and_values_only():
    vocab = 5 * CHUNK
    values = randn(4, vocab, g=gen(2), dtype=torch.float32)
    inv_temperature, keys, positions = _inputs(4, 7)
    together = run(values, inv_temperature, keys, positions)
    for row in range(4):
        alone = run(values[row : row + 1], inv_temperature[row : row + 1],
                    keys[row : row + 1], positions[row : row + 1])  # fmt: skip
        assert alone.item() == together[row].item()
    moved = run(values, inv_temperature, keys, positions + 1)
    assert not torch.equal(moved, together) or vocab < 10  # another position, other noise


def test_draws_follow_the_softmax():
    """Over many positions one row's draws have its softmax's frequencies."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    n = 4000
    values = probs.log().expand(n, -1).contiguous().to(DEVICE)
    ones = torch.ones(n, device=DEVICE)
    keys = torch.full((n,), 12345, dtype=torch.int64, device=DEVICE)
    positions = torch.arange(n, device=DEVICE)
    tokens = race_rows(values, ones, keys, positions).cpu()
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert torch.allclose(freq, probs.double(), atol=0.03), f"{freq.tolist()}"
    # Temperature 0.5 squares the probabilities before normalising.
    sharp = race_rows(values, 2 * ones, keys, positions).cpu()
    expected = probs**2 / (probs**2).sum()
    freq = torch.bincount(sharp, minlength=5).double() / n
    assert torch.allclose(freq, expected.double(), atol=0.03), f"{freq.tolist()}"


def test_the_noise_is_positive_and_finite_at_qwen3s_width():
    """Every token's Exp(1) noise is above 0: a 0 would make its -log E infinite, so the
    token would win whatever its score (about one row in a hundred at this width, with a
    24-bit uniform that rounded its top value to 1.0), and a masked token's -inf a NaN."""
    from worker_proc.sampling_noise import seed_key, seeded_exponentials, vocab_salt

    vocab = 151936
    salt = vocab_salt(vocab, torch.device("cpu"))
    for start in range(0, 600, 100):
        positions = torch.arange(start, start + 100)
        keys = torch.full((100,), seed_key(start))
        noise = seeded_exponentials(keys, positions, salt)
        assert noise.min() > 0 and torch.isfinite(noise.log()).all()


def test_a_row_with_one_allowed_token_draws_it_at_every_position():
    vocab = 151936
    values = torch.full((1, vocab), float("-inf"))
    values[0, 92] = 0.0
    keys = torch.tensor([-1])
    for position in range(600):
        positions = torch.tensor([position])
        assert race_rows_ref(values, torch.ones(1), keys, positions, position).item() == 92
    if CUDA:
        values = values.to(DEVICE).repeat(64, 1)
        keys = torch.arange(64, device=DEVICE)
        for position in range(0, 600, 7):
            positions = torch.full((64,), position, dtype=torch.int64, device=DEVICE)
            tokens = run(values, torch.ones(64, device=DEVICE), keys, positions, position)
            assert (tokens == 92).all()


def test_reference_noise_is_the_samplers():
    """The reference's noise is sampling_noise's, so the kernel's is too (tested above)."""
    from worker_proc.sampling_noise import seed_key, seeded_exponentials, vocab_salt

    values = torch.zeros(2, 300)
    keys = torch.tensor([seed_key(5), seed_key(6)])
    positions = torch.tensor([10, 11])
    noise = seeded_exponentials(keys, positions, vocab_salt(300, torch.device("cpu")))
    # With equal values the race is the smallest noise.
    expected = noise.argmin(dim=-1)
    assert torch.equal(race_rows_ref(values, torch.ones(2), keys, positions), expected)


def test_unseeded_rows_draw_afresh_at_each_call():
    values = torch.zeros(2, 3 * CHUNK, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    keys = torch.tensor([-1, 99], device=DEVICE)
    positions = torch.tensor([5, 5], device=DEVICE)
    draws = [run(values, ones, keys, positions, call_key).tolist() for call_key in range(6)]
    assert len({d[0] for d in draws}) > 3  # the unseeded row follows the call
    assert len({d[1] for d in draws}) == 1  # the seeded row does not
    assert draws[0][0] != draws[0][1]
    with pytest.raises(ValueError, match="call_key"):
        run(values, ones, keys, positions, 2**31)


def test_dispatch_checks_shapes():
    with pytest.raises(ValueError, match="rows, vocab"):
        race_rows(torch.zeros(5), torch.ones(1), torch.zeros(1, dtype=torch.long),
                  torch.zeros(1, dtype=torch.long))  # fmt: skip
    with pytest.raises(ValueError, match="keys"):
        race_rows(torch.zeros(2, 5), torch.ones(2), torch.zeros(3, dtype=torch.long),
                  torch.zeros(2, dtype=torch.long))  # fmt: skip
