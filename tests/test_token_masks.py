"""The worker's side of structured output: the bitmask edit of the logits, its gate, and
the sampler drawing only allowed tokens."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pegainfer.protocol import SamplingParams, StructuredOutput
from worker_proc.logit_edits import AllowedTokens, allowed_tokens, first_masks
from worker_proc.penalties import PenaltyTable
from worker_proc.sampler import Sampler
from worker_proc.upload import Uploader

# -- the worker's mask ----------------------------------------------------------------------


def reference_mask(logits: torch.Tensor, rows: list[int], words: np.ndarray) -> torch.Tensor:
    expected = logits.clone()
    vocab = logits.shape[1]
    for row, row_words in zip(rows, words):
        for token in range(vocab):
            if not (int(row_words[token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


@pytest.mark.parametrize("vocab", [31, 64, 100, 1000])
def test_the_mask_sets_every_disallowed_logit_to_minus_infinity(vocab) -> None:
    generator = np.random.default_rng(vocab)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab))
    rows = [3, 0]
    words = generator.integers(-(2**31), 2**31, size=(2, (vocab + 31) // 32), dtype=np.int64)
    words = words.astype(np.int32)
    expected = reference_mask(logits, rows, words)
    samplers = [type("Seq", (), {"seq_id": s})() for s in (10, 11, 12, 13, 14)]
    edit = allowed_tokens(
        [13, 10], words.astype("<i4").tobytes(), samplers, vocab, Uploader(torch.device("cpu"))
    )
    assert edit is not None
    edit.apply(logits)
    assert torch.equal(logits, expected)


def test_the_mask_refuses_rows_that_do_not_sample_and_short_bitmasks() -> None:
    samplers = [type("Seq", (), {"seq_id": 4})()]
    uploader = Uploader(torch.device("cpu"))
    with pytest.raises(ValueError, match="samples no token"):
        allowed_tokens([5], bytes(16), samplers, 100, uploader)
    with pytest.raises(ValueError, match="bitmask"):
        allowed_tokens([4], bytes(8), samplers, 100, uploader)
    assert allowed_tokens([], b"", samplers, 100, uploader) is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias_ids=[3], logit_bias_values=[100.0]),
    ],
)  # fmt: skip
def test_the_sampler_draws_only_allowed_tokens(params) -> None:
    vocab, rows = 300, 4
    sampler = Sampler(torch.device("cpu"))
    allowed_sets = [[7, 8], [250], [0, 31, 32, 299], [3 + 32 * i for i in range(9)]]
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.uint32)
    for row, ids in enumerate(allowed_sets):
        for token in ids:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    edit = AllowedTokens(torch.arange(rows), torch.from_numpy(words.view(np.int32)))
    cpu = torch.device("cpu")
    penalties = PenaltyTable(vocab, cpu, Uploader(cpu))
    table_rows = [penalties.admit([1, 2, 3], 3) for _ in range(rows)]
    batch = sampler.prepare([params] * rows, vocab, table_rows)
    for draw in range(20):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(draw))
        tokens = sampler.sample(logits, batch, penalties=penalties, allowed=edit).tolist()
        for token, ids in zip(tokens, allowed_sets):
            assert token in ids
        if params.temperature == 0.0:
            masked = reference_mask(logits, list(range(rows)), words.view(np.int32))
            assert tokens == masked.argmax(dim=1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_constrained_rows_draw_only_allowed_tokens() -> None:
    """bf16 logits of Qwen3's width, as a decode graph leaves them with its argmax: the
    argmax is not used for a masked row, and every draw is an allowed token."""
    cuda = torch.device("cuda")
    vocab, rows = 151936, 8
    generator = np.random.default_rng(0)
    allowed_sets = [np.sort(generator.choice(vocab, size=1 + 7 * row, replace=False)) for row in range(rows)]  # fmt: skip
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.uint32)
    for row, ids in enumerate(allowed_sets):
        np.bitwise_or.at(words[row], ids // 32, (np.uint32(1) << (ids % 32).astype(np.uint32)))
    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_p=0.95, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.9),
    ):
        for device in (torch.device("cpu"), cuda):
            sampler = Sampler(device, uploader=Uploader(device))
            batch = sampler.prepare([params] * rows, vocab)
            uploader = Uploader(device)
            samplers = [type("Seq", (), {"seq_id": s})() for s in range(rows)]
            edit = allowed_tokens(
                list(range(rows)), words.view(np.int32).tobytes(), samplers, vocab, uploader
            )
            for draw in range(5):
                logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(draw))
                logits = logits.to(torch.bfloat16).to(device)
                greedy = logits.argmax(dim=1)  # what the graph took, unmasked
                tokens = sampler.sample(logits, batch, greedy_tokens=greedy, allowed=edit)
                tokens = tokens.cpu().tolist()
                for token, ids in zip(tokens, allowed_sets):
                    assert token in ids, (params, device)
                if params.temperature == 0.0:
                    best = [int(ids[logits[row, ids].float().argmax().item()]) for row, ids in enumerate(allowed_sets)]  # fmt: skip
                    assert tokens == best


def sequence(seq_id: int, gate: int | None, words: np.ndarray | None = None):
    structured = None if gate is None else StructuredOutput("regex", "x", after_token_id=gate)
    first_mask = None if words is None else torch.from_numpy(words.astype(np.int32))
    sampling = SamplingParams(structured=structured)
    return SimpleNamespace(seq_id=seq_id, sampling=sampling, first_mask=first_mask)


def test_a_first_mask_holds_only_after_the_token_that_wakes_its_grammar() -> None:
    vocab = 70
    uploader = Uploader(torch.device("cpu"))
    words = np.zeros(3, dtype=np.int32)
    words[0] = 0b1010  # tokens 1 and 3 only
    # Seq 7 waits for token 5, seq 8 for token 6; seq 9 has no sleeping grammar.
    samplers = [sequence(7, 5, words), sequence(8, 6, words), sequence(9, None)]
    gated = first_masks([7, 8], samplers, uploader)
    last_tokens = torch.tensor([0, 5, 5, 5])  # per slot; the rows sit in slots 1, 2, 3
    gated.open_gates(last_tokens, torch.tensor([1, 2, 3]))
    logits = torch.randn(3, vocab)
    gated.apply(logits)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [1, 3]
    assert torch.isfinite(logits[1:]).all()  # seq 8's token before was 5, not its 6
    with pytest.raises(ValueError, match="no grammar waiting"):
        first_masks([9], samplers, uploader)
    with pytest.raises(ValueError, match="samples no token"):
        first_masks([4], samplers, uploader)
