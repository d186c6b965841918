"""The batched GPU sampler, run on the CPU: greedy, temperature, top-k/top-p/min-p,
penalties, and counter-based seeded draws that depend only on (seed, position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pegainfer.protocol import SamplingParams
from worker_proc import sampler as sampler_module
from worker_proc.sampler import (
    CANDIDATES,
    Sampler,
    mix32,
    mix32_int,
    seed_key,
    seeded_exponentials,
)
from worker_proc.sampling_noise import vocab_salt
from worker_proc.upload import Uploader

GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def _sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.device("cpu"), seed=seed)


def _sample(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int] | None = None,
) -> torch.Tensor:
    batch = sampler.prepare(params, logits.shape[1])
    pos = torch.tensor(positions if positions is not None else [0] * len(params))
    return sampler.sample(logits, batch, pos)


def _draw(params: SamplingParams, probs: list[float], n: int = 4000) -> torch.Tensor:
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    return _sample(_sampler(), logits, [params] * n, list(range(n)))


def test_greedy_is_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    tokens = _sample(_sampler(), logits, [GREEDY] * 16)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    tiny = SamplingParams(temperature=1e-6)
    assert _sample(_sampler(), logits, [tiny] * 16).tolist() == tokens.tolist()
    batch = _sampler().prepare([GREEDY] * 16, 300)
    assert batch.all_greedy and batch.groups == [] and batch.greedy is None  # nothing uploaded


def test_bfloat16_logits_sample_as_their_float32_copy():
    """The worker hands over the model's logits: greedy rows take their argmax as they are,
    and a mixed batch samples exactly as it would from a float32 copy."""
    logits = torch.randn(12, 300, generator=torch.Generator().manual_seed(5)).bfloat16()
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the lower id wins either way
    assert _sample(_sampler(), logits, [GREEDY] * 12).tolist() == (
        logits.float().argmax(dim=-1).tolist()
    )
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=3)] * 6
    positions = list(range(12))
    mixed = _sample(_sampler(1), logits, params, positions)
    assert mixed.tolist() == _sample(_sampler(1), logits.float(), params, positions).tolist()
    assert mixed[3].item() == 7


def test_top_k_one_equals_greedy():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.5, top_k=1)] * 32
    tokens = _sample(_sampler(), logits, params)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_plain_sampling_follows_the_distribution():
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = torch.bincount(_draw(SamplingParams(temperature=1.0), probs), minlength=4)
    freq = counts.double() / counts.sum()
    assert torch.allclose(freq, torch.tensor(probs, dtype=torch.float64), atol=0.03)


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, -5])
def test_seeded_sampling_follows_the_distribution(seed):
    """The hash-based noise is as good as a generator's: frequencies over positions match."""
    probs = [0.5, 0.3, 0.15, 0.05]
    counts = torch.bincount(
        _draw(SamplingParams(temperature=1.0, seed=seed), probs, n=6000), minlength=4
    )
    freq = counts.double() / counts.sum()
    assert torch.allclose(freq, torch.tensor(probs, dtype=torch.float64), atol=0.03)


def test_seeded_noise_is_uniform_and_uncorrelated():
    salt = vocab_salt(1000, CPU)
    keys = torch.tensor([seed_key(s) for s in range(64)])
    noise = seeded_exponentials(keys, torch.arange(64), salt)
    uniform = torch.exp(-noise).flatten().numpy()  # back to U(0, 1)
    hist, _ = np.histogram(uniform, bins=20, range=(0, 1))
    expected = uniform.size / 20
    chi2 = (((hist - expected) ** 2) / expected).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 0.001 above ~43.8
    # Neighbouring positions and seeds give unrelated rows.
    corr = np.corrcoef(noise.numpy())
    assert np.abs(corr[np.triu_indices(64, 1)]).max() < 0.2


def test_mix32_matches_python_and_is_a_bijection_sample():
    values = [0, 1, 2, 12345, 2**31, 2**32 - 1]
    tensor = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert tensor == [mix32_int(v) for v in values]
    assert all(0 <= v < 2**32 for v in tensor)
    many = mix32(torch.arange(100_000, dtype=torch.int64))
    assert many.unique().numel() == 100_000
    assert seed_key(-1) == seed_key(2**64 - 1) and seed_key(1) != seed_key(2)


def test_top_k_top_p_min_p_masks():
    probs = [0.5, 0.3, 0.15, 0.05]
    seen = set(_draw(SamplingParams(temperature=1.0, top_k=2), probs).tolist())
    assert seen == {0, 1}
    # top_p 0.7: token 1 is kept (0.5 before it), token 2 is not (0.8 before it).
    seen = set(_draw(SamplingParams(temperature=1.0, top_p=0.7), probs).tolist())
    assert seen == {0, 1}
    seen = set(_draw(SamplingParams(temperature=1.0, top_p=0.1), probs).tolist())
    assert seen == {0}
    # min_p 0.2: threshold 0.2 * 0.5 = 0.1 keeps tokens 0, 1 and 2.
    seen = set(_draw(SamplingParams(temperature=1.0, min_p=0.2), probs).tolist())
    assert seen == {0, 1, 2}
    # After top_k=3 renormalises to [0.526, 0.316, 0.158], top_p=0.8 drops token 2.
    seen = set(_draw(SamplingParams(temperature=1.0, top_k=3, top_p=0.8), probs).tolist())
    assert seen == {0, 1}


def test_top_k_rows_mixed_with_unfiltered_rows():
    """The top-k path without a sort: rows without top-k keep their whole vocabulary."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 3000
    logits = probs.log().expand(n, -1).contiguous()
    params = [
        SamplingParams(temperature=1.0, top_k=2) if i % 2 else SamplingParams(temperature=1.0)
        for i in range(n)
    ]
    tokens = _sample(_sampler(), logits, params, list(range(n)))
    assert set(tokens[1::2].tolist()) == {0, 1}
    assert set(tokens[0::2].tolist()) == {0, 1, 2, 3}


def _full_path_only(monkeypatch) -> None:
    monkeypatch.setattr(sampler_module, "CANDIDATES", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_candidate_path_draws_what_the_whole_vocabulary_draws(monkeypatch, dtype):
    """Rows with a top-k of at most CANDIDATES are drawn from their largest scores only:
    the same tokens as the draw over the whole vocabulary, for every filter combination,
    whether the logits come as the model's bfloat16 or as float32."""
    vocab, rows = 5000, 96
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(11)) * 3
    logits = logits.to(dtype)
    settings = [
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=50),
        SamplingParams(temperature=0.8, top_k=128, min_p=0.05),
        SamplingParams(temperature=1.3, top_k=7, top_p=0.5, min_p=0.1),
    ]
    params = [SamplingParams(**{**vars(settings[i % 4]), "seed": 1000 + i}) for i in range(rows)]
    positions = list(range(40, 40 + rows))
    batch = _sampler().prepare(params, vocab)
    assert [g.path for g in batch.groups] == ["candidates"]
    candidates = _sample(_sampler(), logits, params, positions)
    _full_path_only(monkeypatch)
    assert [g.path for g in _sampler().prepare(params, vocab).groups] == ["filtered"]
    assert candidates.tolist() == _sample(_sampler(), logits, params, positions).tolist()


def test_nucleus_path_draws_what_the_sorted_cut_draws():
    """Rows with top-p or min-p and no top-k take the sort-free search: the same tokens as
    the sorted cut and the race over what it keeps."""
    vocab, rows = 4000, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(12)) * 3
    settings = [
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.2, top_p=0.5, min_p=0.1),
        SamplingParams(
            temperature=0.9, top_p=0.99, top_k=vocab
        ),  # top-k of the whole vocabulary: off
    ]
    params = [SamplingParams(**{**vars(settings[i % 4]), "seed": 2000 + i}) for i in range(rows)]
    positions = torch.arange(7, 7 + rows)
    sampler = _sampler()
    batch = sampler.prepare(params, vocab)
    (group,) = batch.groups
    assert group.path == "nucleus"
    drawn = sampler.sample(logits, batch, positions)
    expected = sampler._draw_filtered(logits, group, positions, 0)
    assert drawn.tolist() == expected.tolist()


def test_candidate_path_follows_the_filtered_distribution():
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02])
    # top_k 5 renormalises to [0.353, 0.235, 0.176, 0.118, 0.118]; top_p 0.7 keeps the
    # first three (0.588 before the third, 0.765 before the fourth).
    kept = probs[:3] / probs[:3].sum()
    for seed in (None, 3):
        params = SamplingParams(temperature=1.0, top_k=5, top_p=0.7, seed=seed)
        counts = torch.bincount(_draw(params, probs.tolist(), n=6000), minlength=8)
        freq = counts.double() / counts.sum()
        assert counts[3:].sum() == 0
        assert torch.allclose(freq[:3], kept.double(), atol=0.03)


def test_each_row_takes_its_own_path_whatever_the_batch(monkeypatch):
    """A seeded top-k row draws the same token alone and beside rows of the other path
    (top-p alone, a top-k past CANDIDATES), greedy rows and unseeded rows."""
    vocab = 3000
    crowd = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2)) * 2
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)) * 2
    seeded = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=42)
    others = [
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=CANDIDATES + 1, seed=1),
        GREEDY,
        SamplingParams(temperature=0.9, top_k=5),
        SamplingParams(temperature=1.0),
    ]
    batch = _sampler().prepare([*others[:2], seeded, *others[2:]], vocab)
    assert sorted(g.path for g in batch.groups) == ["candidates", "filtered", "nucleus", "race"]
    for position in range(10, 20):
        alone = _sample(_sampler(), row, [seeded], [position]).item()
        logits = torch.cat([crowd[:2], row, crowd[2:]])
        params = [*others[:2], seeded, *others[2:]]
        tokens = _sample(_sampler(5), logits, params, [1, 2, position, 3, 4, 5])
        assert tokens[2].item() == alone
        assert tokens[3].item() == crowd[2].argmax().item()


def test_mixed_batch_applies_each_rows_settings():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = probs.log().expand(6, -1).contiguous()
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=1.0, seed=5, top_k=1),
        SamplingParams(temperature=0.5, min_p=0.9),
        GREEDY,
    ]
    assert _sample(_sampler(), logits, params).tolist() == [3] * 6


def test_low_temperature_sharpens():
    probs = [0.3, 0.25, 0.25, 0.2]
    sharp = _draw(SamplingParams(temperature=0.05), probs, n=2000)
    assert (sharp == 0).double().mean() > 0.9
    flat = _draw(SamplingParams(temperature=1.0), probs, n=2000)
    assert (flat == 0).double().mean() < 0.4


def test_seeded_draw_depends_only_on_seed_and_position():
    """Same (seed, position) -> same token, whatever the other rows, the row index, the
    sampler's own seed or how many draws came before; another position -> other draws."""
    logits = torch.zeros(1, 1000)
    seeded = SamplingParams(temperature=1.0, seed=7)
    alone = [_sample(_sampler(), logits, [seeded], [p]).item() for p in range(20, 30)]
    assert len(set(alone)) > 5  # positions give different draws

    other = Sampler(torch.device("cpu"), seed=123)
    for _ in range(3):  # advance the sampler's call count
        _sample(other, logits, [SamplingParams(temperature=1.0)])
    crowd = torch.randn(4, 1000, generator=torch.Generator().manual_seed(9))
    for position, expected in zip(range(20, 30), alone):
        batch_logits = torch.cat([crowd[:2], logits, crowd[2:]])
        params = [
            SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, seed=8),
            seeded,
            GREEDY,
            SamplingParams(temperature=1.0, top_p=0.5),
        ]
        tokens = _sample(other, batch_logits, params, [5, position, position, 0, 3])
        assert tokens[2].item() == expected

    different = [
        _sample(_sampler(), logits, [SamplingParams(temperature=1.0, seed=8)], [p]).item()
        for p in range(20, 30)
    ]
    assert different != alone


def test_unseeded_rows_vary():
    logits = torch.zeros(1, 1000)
    unseeded = SamplingParams(temperature=1.0)
    shared = _sampler()
    draws = {_sample(shared, logits, [unseeded]).item() for _ in range(6)}
    assert len(draws) > 1


def test_seeded_rows_need_positions():
    sampler = _sampler()
    batch = sampler.prepare([SamplingParams(temperature=1.0, seed=1)], 10)
    with pytest.raises(ValueError, match="positions"):
        sampler.sample(torch.zeros(1, 10), batch)


def test_uploader_packs_arrays_and_rings():
    uploader = Uploader(torch.device("cpu"), ring_size=2, initial_bytes=8)
    arrays = [
        np.arange(5, dtype=np.int64),
        np.array([], dtype=np.int64),
        np.array([-1, 7, 3], dtype=np.int32),
        np.array([0.5, 2.0], dtype=np.float32),
        np.array([True, False, True]),
        np.arange(6, dtype=np.int32).reshape(2, 3),
    ]
    first = uploader.upload(arrays)  # grows past initial_bytes
    for got, want in zip(first, arrays):
        assert got.shape == want.shape and got.numpy().tolist() == want.tolist()
    assert first[2].dtype == torch.int32 and first[4].dtype == torch.bool
    kept = uploader.upload([np.array([42], dtype=np.int64)], persistent=True)[0]
    second = uploader.upload([np.array([9, 9], dtype=np.int64)])
    third = uploader.upload([np.array([1, 1], dtype=np.int64)])
    assert second[0].tolist() == [9, 9] and third[0].tolist() == [1, 1]
    assert kept.tolist() == [42]  # persistent tensors own their memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_matches_cpu():
    """The counter-based noise is the same integer function on both devices, so seeded
    draws agree; all other settings run on the device without per-row host work."""
    cuda = torch.device("cuda")
    keys = torch.tensor([seed_key(s) for s in (1, 2, 2**40)])
    positions = torch.tensor([5, 6, 7])
    cpu_bits = mix32(keys.unsqueeze(1) ^ mix32(torch.arange(5000)).unsqueeze(0))
    gpu_bits = mix32(keys.to(cuda).unsqueeze(1) ^ mix32(torch.arange(5000, device=cuda)))
    assert torch.equal(cpu_bits, gpu_bits.cpu())
    salt = vocab_salt(5000, CPU)
    torch.testing.assert_close(
        seeded_exponentials(keys, positions, salt),
        seeded_exponentials(keys.to(cuda), positions.to(cuda), salt.to(cuda)).cpu(),
    )
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(3)) * 3
    params = [
        [
            SamplingParams(temperature=0.8, seed=i),
            SamplingParams(temperature=1.0, top_k=20, seed=i),
            SamplingParams(temperature=1.0, top_p=0.8, min_p=0.05, seed=i),
            GREEDY,
            SamplingParams(temperature=0.9),  # unseeded: the same call count on both
        ][i % 5]
        for i in range(64)
    ]
    pos = list(range(100, 164))
    on_cpu = _sample(_sampler(), logits, params, pos)
    on_gpu = _sample(Sampler(cuda), logits.to(cuda), params, pos).cpu()
    assert (on_cpu == on_gpu).float().mean() >= 0.95  # float rounding may split near-ties
    assert torch.equal(on_cpu[3::5], on_gpu[3::5])  # greedy rows exactly
