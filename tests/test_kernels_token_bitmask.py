"""The grammar-mask kernel against its reference: random masks over a subset of the rows,
gated rows whose gate is open or shut, vocabularies that end inside a word, and masks
wider than the vocabulary."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, gen, randn, requires_triton

from kernels.token_bitmask import apply_token_bitmask_ref, apply_token_bitmask_triton

pytestmark = requires_triton

# Small blocks on the CPU interpreter, so that a short row still spans several programs.
BLOCK = 4096 if CUDA else 64


def random_masks(rows: int, words: int, g: torch.Generator) -> torch.Tensor:
    bits = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64)
    masks = bits.to(torch.int32)
    masks[0, :] = -1  # a row that allows every token
    if rows > 1:
        masks[1, :] = 0  # and one that allows none
        masks[1, 0] = 1 << 3  # but token 3
    return masks.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "vocab, extra_words", [(50, 0), (1000, 1), (64 * 5 + 7, 2)] + ([(151936, 0)] if CUDA else [])
)
@pytest.mark.parametrize("gated", [False, True])
def test_the_kernel_writes_what_the_reference_writes(dtype, vocab, extra_words, gated):
    g = gen(11)
    num_rows = 9
    logits = randn(num_rows, vocab, g=g, dtype=dtype)
    batch_rows = torch.tensor([7, 0, 3, 5, 8], device=DEVICE)
    words = (vocab + 31) // 32 + extra_words
    masks = random_masks(len(batch_rows), words, g)
    gates = previous = None
    if gated:
        # Row 0: no gate; 1 and 3: open (previous == gate); 2 and 4: shut.
        gates = torch.tensor([-1, 17, 4, 9, 0], device=DEVICE)
        previous = torch.tensor([5, 17, 5, 9, 1], device=DEVICE)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, batch_rows, masks, gates, previous)
    apply_token_bitmask_triton(logits, batch_rows, masks, gates, previous, block=BLOCK)
    assert torch.equal(logits, expected), f"seed {SEED}"
    assert not logits.isnan().any()
    # Rows outside the masks are untouched, as are the one that allows all (7) and those
    # whose gate is shut; row 0 keeps token 3 alone.
    untouched = [1, 2, 4, 6, 7] + ([3, 8] if gated else [])
    assert torch.isfinite(logits[untouched]).all()
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("apply", [apply_token_bitmask_ref, apply_token_bitmask_triton])
def test_no_masked_rows_or_every_gate_shut_is_nothing_to_do(apply):
    logits = randn(3, 100, g=gen(12), dtype=torch.float32)
    before = logits.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    apply(logits, empty, torch.empty(0, 4, dtype=torch.int32, device=DEVICE))
    rows = torch.tensor([0, 2], device=DEVICE)
    masks = torch.zeros(2, 4, dtype=torch.int32, device=DEVICE)  # nothing allowed
    gates = torch.tensor([7, 8], device=DEVICE)
    apply(logits, rows, masks, gates, torch.tensor([1, 1], device=DEVICE))  # both shut
    assert torch.equal(logits, before)


def test_the_reference_keeps_a_logit_exactly_where_its_bit_is_set():
    g = gen(13)
    vocab = 200
    logits = randn(4, vocab, g=g, dtype=torch.float32).cpu()
    logits[2, :3] = torch.tensor([float("inf"), -0.0, float("-inf")])
    masks = random_masks(3, (vocab + 31) // 32, g).cpu()
    batch_rows = torch.tensor([2, 0, 3])
    written = logits.clone()
    apply_token_bitmask_ref(written, batch_rows, masks)
    for index, row in enumerate(batch_rows.tolist()):
        for token in range(vocab):
            allowed = int(masks[index, token // 32]) >> (token % 32) & 1
            expected = logits[row, token] if allowed else torch.tensor(float("-inf"))
            assert torch.equal(written[row, token], expected), (row, token)
            assert written[row, token].signbit() == expected.signbit()
    assert torch.equal(written[1], logits[1])
