"""The greedy argmax kernel against ``torch.argmax``: random rows, ties inside one chunk and
across chunks (the first column must win whichever program finishes last), NaN and -inf
rows, and a strided view of the logits."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, gen, poisoned, randn, requires_triton

from kernels.argmax import argmax_rows, argmax_rows_ref, argmax_rows_triton

pytestmark = requires_triton

# Small chunks on the CPU interpreter, so that a short row still spans several programs.
CHUNK = 4096 if CUDA else 64


def run(logits: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    with poisoned():
        return argmax_rows_triton(logits, chunk=chunk)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, vocab", [(1, 50), (3, 1000), (5, 64 * 7)] + ([(8, 151936), (64, 151936)] if CUDA else [])
)
def test_argmax_matches_torch(dtype, rows, vocab):
    logits = randn(rows, vocab, g=gen(1), dtype=dtype, scale=4.0)
    tokens = run(logits)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, argmax_rows_ref(logits)), f"seed {SEED}"


def test_ties_take_the_first_column():
    rows, vocab = 4, 10 * CHUNK + 3
    logits = randn(rows, vocab, g=gen(2), dtype=torch.bfloat16)
    g = gen(3)
    expected = []
    for row in range(rows):
        # The maximum appears in several chunks, the first of them not the first chunk, and
        # twice inside the chunk that holds the first occurrence.
        columns = sorted(torch.randperm(vocab, generator=g)[:5].tolist())
        logits[row, columns] = 100.0
        expected.append(columns[0])
    logits[3, vocab - 1] = 200.0  # the last column alone
    expected[3] = vocab - 1
    for _ in range(3):  # programs finish in another order each time on a GPU
        assert run(logits).tolist() == expected, f"seed {SEED}"


def test_nan_and_infinite_rows():
    vocab = 5 * CHUNK
    logits = randn(3, vocab, g=gen(4), dtype=torch.float32)
    logits[0] = float("-inf")  # every column -inf: column 0, as torch gives
    logits[1, 3 * CHUNK + 7] = float("nan")
    logits[2, CHUNK + 1] = float("inf")
    tokens = run(logits)
    assert tokens.tolist() == [0, 3 * CHUNK + 7, CHUNK + 1]
    assert tokens.tolist() == argmax_rows_ref(logits).tolist()


def test_strided_rows_and_out_buffer():
    wide = randn(6, 3 * CHUNK + 40, g=gen(5), dtype=torch.bfloat16)
    logits = wide[:, 17 : 17 + 2 * CHUNK + 5]  # rows strided by the wider tensor
    out = torch.full((6,), -1, dtype=torch.int64, device=DEVICE)
    argmax_rows_triton(logits, out=out, chunk=CHUNK)
    assert torch.equal(out, argmax_rows_ref(logits))


def test_dispatch_checks_shapes_and_writes_out():
    logits = torch.randn(3, 20)
    out = torch.empty(3, dtype=torch.int64)
    assert argmax_rows(logits, out=out) is out
    assert torch.equal(out, logits.argmax(dim=-1))
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.randn(20))
    with pytest.raises(ValueError, match="int64"):
        argmax_rows(logits, out=torch.empty(3, dtype=torch.int32))


def test_counters_are_left_at_zero():
    from kernels.attention_merge import split_counters

    logits = randn(7, 4 * CHUNK, g=gen(6), dtype=torch.float32)
    first = run(logits)
    assert int(split_counters(7, logits.device)[:7].abs().sum()) == 0
    assert torch.equal(run(logits), first)
