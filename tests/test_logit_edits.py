"""logit_bias and the min_tokens mask (worker_proc/logit_edits.py): sparse edits of the raw
logits before the penalties, on greedy and sampled rows alike."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pegainfer.protocol import SamplingParams
from worker_proc.logit_edits import (
    StopMasks,
    bias_edits,
    needs_stop_mask,
    stop_mask_edits,
    stop_token_ids,
)
from worker_proc.penalties import PenaltyTable
from worker_proc.sampler import Sampler
from worker_proc.upload import Uploader

CPU = torch.device("cpu")
VOCAB = 50


def uploader() -> Uploader:
    return Uploader(CPU)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def biased(ids: list[int], values: list[float], **fields) -> SamplingParams:
    return SamplingParams(logit_bias_ids=ids, logit_bias_values=values, **fields)


def test_the_bias_adds_each_value_once_whatever_the_padding():
    params = [
        biased([3], [2.5]),
        SamplingParams(),
        biased([0, 7, 49], [-1.0, 4.0, 0.5]),
    ]
    edits = bias_edits(params, uploader())
    assert edits is not None and edits.add
    assert edits.batch_rows.tolist() == [0, 2]
    assert edits.token_ids.tolist() == [[3, 3, 3], [0, 7, 49]]  # padded with a repeat
    logits = random_logits(3)
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[2, 0] -= 1.0
    expected[2, 7] += 4.0
    expected[2, 49] += 0.5
    edits.apply(logits)
    assert torch.equal(logits, expected)
    assert bias_edits([SamplingParams()] * 2, uploader()) is None


def test_the_stop_mask_sets_minus_infinity_at_each_rows_stop_tokens():
    edits = stop_mask_edits([1, 2, 3], [[5], [], [6, 9]], uploader())
    assert edits is not None and not edits.add
    assert edits.batch_rows.tolist() == [1, 3]
    logits = random_logits(4)
    expected = logits.clone()
    expected[1, 5] = expected[3, 6] = expected[3, 9] = float("-inf")
    edits.apply(logits)
    assert torch.equal(logits, expected)
    assert stop_mask_edits([0], [[]], uploader()) is None


def test_the_stop_tokens_are_the_requests_and_the_models_eos_unless_ignored():
    assert stop_token_ids(SamplingParams(stop_token_ids=[4, 2]), [2, 9]) == [4, 2, 9]
    assert stop_token_ids(SamplingParams(stop_token_ids=[4], ignore_eos=True), [2]) == [4]
    # The token drawn after n outputs is output n + 1; it may stop from min_tokens on.
    params = SamplingParams(min_tokens=3)
    assert [needs_stop_mask(params, n) for n in range(4)] == [True, True, False, False]


@dataclass
class FakeSequence:
    sampling: SamplingParams
    num_tokens: int
    num_prompt_tokens: int = 10


def test_the_masks_follow_the_rows_lengths_and_upload_only_on_a_change():
    masks = StopMasks([0], uploader())
    short = FakeSequence(SamplingParams(min_tokens=3), 10)
    longer = FakeSequence(SamplingParams(min_tokens=4, stop_token_ids=[7]), 10)
    free = FakeSequence(SamplingParams(min_tokens=3, ignore_eos=True), 10)  # nothing to mask
    masks.compose([short, FakeSequence(SamplingParams(), 10), longer, free])
    first = masks.for_step()
    assert first is not None and first.batch_rows.tolist() == [0, 2]
    assert first.token_ids.tolist() == [[0, 0], [7, 0]]
    assert masks.for_step() is first  # the same rows: nothing uploaded again
    short.num_tokens = longer.num_tokens = 12  # two outputs each
    second = masks.for_step()
    assert second is not None and second.batch_rows.tolist() == [2]
    longer.num_tokens = 13
    assert masks.for_step() is None
    masks.compose([FakeSequence(SamplingParams(), 10)])
    assert masks.for_step() is None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    stop_mask=None,
    greedy_tokens=None,
    penalties=None,
    penalty_rows=None,
) -> list[int]:
    sampler = Sampler(CPU, seed=0)
    batch = sampler.prepare(params, VOCAB, penalty_rows)
    positions = torch.arange(len(params))
    return sampler.sample(
        logits, batch, positions, penalties, greedy_tokens=greedy_tokens, stop_mask=stop_mask
    ).tolist()


def test_greedy_rows_take_the_edited_argmax_not_the_graphs():
    logits = random_logits(3, seed=1)
    argmax = logits.argmax(dim=-1)
    second = logits.topk(2, dim=-1).indices[:, 1]
    params = [
        biased([int(argmax[0])], [-100.0], temperature=0.0),
        SamplingParams(temperature=0.0, min_tokens=5),
        biased([11], [100.0], temperature=0.0),
    ]
    mask = stop_mask_edits([1], [[int(argmax[1])]], uploader())
    tokens = sample(logits, params, stop_mask=mask, greedy_tokens=argmax.clone())
    assert tokens == [int(second[0]), int(second[1]), 11]
    original = logits.clone()
    sample(logits, params, stop_mask=mask)
    assert torch.equal(logits, original)  # the model's logits stay as they were


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
        {"temperature": 1.0, "min_p": 0.05},
    ],
)
def test_sampled_rows_never_draw_a_banned_or_masked_token(fields):
    logits = random_logits(64, seed=2).mul(0.3)
    favourites = logits.topk(3, dim=-1).indices
    params, rows, masked = [], [], []
    for row in range(64):
        ban = favourites[row, :2].tolist()
        params.append(biased(ban, [-100.0, -100.0], seed=row, **fields))
        rows.append(row)
        masked.append([int(favourites[row, 2])])
    mask = stop_mask_edits(rows, masked, uploader())
    tokens = sample(logits, params, stop_mask=mask)
    assert all(t not in favourites[row].tolist() for row, t in enumerate(tokens))
    # A bias of +100 makes a token certain at any of these settings.
    forced = [biased([row % VOCAB], [100.0], seed=row, **fields) for row in range(64)]
    assert sample(logits, forced) == [row % VOCAB for row in range(64)]


@pytest.mark.parametrize(("bias", "expected"), [(1.1, 5), (1.3, 4)])
def test_the_bias_comes_before_the_penalties(bias, expected):
    logits = torch.zeros(1, VOCAB)
    logits[0, 4] = 1.0
    logits[0, 5] = 1.8
    table = PenaltyTable(VOCAB, CPU, uploader())
    row = table.admit([4, 4], num_prompt_tokens=2)  # token 4 is in the prompt
    params = [biased([4], [bias], temperature=0.0, repetition_penalty=1.25)]
    # Bias first: (1 + 1.1) / 1.25 = 1.68 < 1.8, (1 + 1.3) / 1.25 = 1.84 > 1.8. The penalty
    # first would make the first 1 / 1.25 + 1.1 = 1.9: token 4.
    assert sample(logits, params, penalties=table, penalty_rows=[row]) == [expected]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_edits_on_a_gpu_agree_with_the_cpu():
    """bf16 logits on the device: greedy rows with a bias or a mask take the CPU's tokens,
    and sampled rows never draw a banned or masked token."""
    cuda = torch.device("cuda")
    logits = random_logits(32, seed=4).to(torch.bfloat16)
    favourites = logits.float().topk(2, dim=-1).indices
    params, rows, masked = [], [], []
    for row in range(32):
        fields = {"temperature": 0.0} if row % 2 else {"temperature": 0.8, "top_k": 20}
        params.append(biased([int(favourites[row, 0])], [-100.0], seed=row, **fields))
        rows.append(row)
        masked.append([int(favourites[row, 1])])
    tokens = {}
    for device in (CPU, cuda):
        sampler = Sampler(device, seed=0)
        batch = sampler.prepare(params, VOCAB)
        mask = stop_mask_edits(rows, masked, Uploader(device))
        positions = torch.arange(32, device=device)
        drawn = sampler.sample(logits.to(device), batch, positions, stop_mask=mask)
        tokens[device.type] = drawn.cpu().tolist()
    for row in range(32):
        assert tokens["cuda"][row] not in favourites[row].tolist()
        if row % 2:
            assert tokens["cuda"][row] == tokens["cpu"][row]
