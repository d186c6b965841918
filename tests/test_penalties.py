"""Repetition, presence and frequency penalties from the token counts kept on the device
(worker_proc/penalties.py): what each penalty does to the logits, the counts following each
sampled token, and the table's rows growing and being reused."""

from __future__ import annotations

import pytest
import torch

from pegainfer.protocol import SamplingParams
from worker_proc.penalties import PenaltyTable
from worker_proc.sampler import Sampler, has_penalties
from worker_proc.upload import Uploader

CPU = torch.device("cpu")


def _sampler() -> Sampler:
    return Sampler(CPU, seed=0)


def _penalised(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], int]],
    table: PenaltyTable | None = None,
) -> tuple[torch.Tensor, PenaltyTable]:
    """One step of rows admitted with (token_ids, num_prompt_tokens) histories."""
    table = table or PenaltyTable(logits.shape[1], torch.device("cpu"), Uploader(CPU))
    rows = [
        table.admit(ids, n) if has_penalties(p) else -1 for p, (ids, n) in zip(params, histories)
    ]
    batch = sampler.prepare(params, logits.shape[1], rows)
    return sampler.sample(logits, batch, torch.zeros(len(params), dtype=torch.long), table), table


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 1.9]])
    sampler = _sampler()
    # Token 0 appeared (in the prompt): 2.0 / 2 = 1.0 drops below token 4's 1.9.
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert _penalised(sampler, logits, [params], [([0, 2], 2)])[0].item() == 4
    # Frequency: token 0 generated twice -> 2.0 - 2 * 0.6 = 0.8; token 4 sits in the prompt
    # only, so it keeps 1.9 and wins.
    params = SamplingParams(temperature=0.0, frequency_penalty=0.6)
    table = PenaltyTable(5, CPU, Uploader(CPU))
    row = table.admit([4, 0, 0], 1)
    rows = torch.tensor([row])
    one = torch.ones(1, 1)
    penalised = table.apply(logits, torch.tensor([0]), rows, one, 0 * one, 0.6 * one)
    assert penalised[0].tolist() == pytest.approx([0.8, 1.0, -1.0, 0.5, 1.9])
    assert _penalised(sampler, logits, [params], [([4, 0, 0], 1)])[0].item() == 4
    # The prompt does not count for presence/frequency.
    assert _penalised(sampler, logits, [params], [([0, 0, 3], 3)])[0].item() == 0
    # Presence: once is enough; 4 is penalised too, so 1 wins.
    params = SamplingParams(temperature=0.0, presence_penalty=1.5)
    assert _penalised(sampler, logits, [params], [([0, 4], 0)])[0].item() == 1
    # Repetition penalty makes a seen negative logit more negative.
    table = PenaltyTable(5, CPU, Uploader(CPU))
    rows = torch.tensor([table.admit([2], 1)])
    penalised = table.apply(logits, torch.tensor([0]), rows, 2 * one, 0 * one, 0 * one)
    assert penalised[0, 2].item() == -2.0 and penalised[0, 1].item() == 1.0
    # Rows without penalties are untouched, and the input is not modified.
    mixed = torch.cat([logits, logits])
    table = PenaltyTable(5, CPU, Uploader(CPU))
    rows = torch.tensor([table.admit([0], 0)])
    out = table.apply(mixed, torch.tensor([1]), rows, one, one, 0 * one)
    assert torch.equal(out[0], logits[0]) and out[1, 0].item() == 1.0
    assert mixed[1, 0].item() == 2.0
    with pytest.raises(ValueError, match="penalty table"):
        sampler.prepare([params], 5)
    batch = sampler.prepare([params], 5, [0])
    with pytest.raises(ValueError, match="penalty table"):
        sampler.sample(logits, batch, torch.zeros(1, dtype=torch.long))


def test_the_penalty_table_counts_each_sampled_token():
    """Each step's drawn tokens are counted on the device: a frequency penalty then steers
    greedy decoding off a token it drew, with no history passed again."""
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0]])
    sampler = _sampler()
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.8)]
    first, table = _penalised(sampler, logits, params, [([3], 1)])
    batch = sampler.prepare(params, 4, [0])
    drawn = [first.item()]
    for _ in range(4):
        drawn.append(sampler.sample(logits, batch, torch.zeros(1, dtype=torch.long), table).item())
    # 3.0 -> 2.2 after one draw, below 2.5; then 2.5 -> 1.7, and so on.
    assert drawn == [0, 1, 0, 2, 1]
    assert table.counts[0].tolist() == [2, 2, 1, 0]
    assert table.prompt_seen[0].tolist() == [False, False, False, True]


def test_the_penalty_table_grows_and_reuses_rows():
    table = PenaltyTable(50, CPU, Uploader(CPU))
    rows = [table.admit([i, i + 1, 40], 2) for i in range(20)]
    assert sorted(rows) == list(range(20)) and table.capacity == 32
    assert table.rows_in_use == 20
    # Earlier rows kept their counts across the growth.
    assert table.counts[0, 40].item() == 1 and table.prompt_seen[0, :2].tolist() == [True, True]
    table.release(rows[3])
    again = table.admit([7], 1)  # a reused row starts clean
    assert again == rows[3] and table.counts[again].sum().item() == 0
    assert table.prompt_seen[again].nonzero().flatten().tolist() == [7]
