"""Each row's k largest values without a radix select: the kernel against ``torch.topk`` on
fresh random rows (both dtypes, several chunks a row), rows of many equal values (the exact
redo), rows mostly -inf, rows with fewer than k finite values, and +inf; the dispatch."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import CUDA, DEVICE, SEED, gen, poisoned, randn, requires_triton

from kernels.top_candidates import (
    GROUPS,
    top_candidates,
    top_candidates_ref,
    top_candidates_triton,
)

pytestmark = requires_triton

# Small groups, chunks and slots on the CPU interpreter, so short rows span several chunks
# and the slots can overflow; the real sizes on a GPU.
SIZES = (
    dict(chunk=8192, groups=256, slots=1024, exact_block=1024, gather_chunk=2048)
    if CUDA
    else dict(chunk=64, groups=16, slots=64, exact_block=32, gather_chunk=128)
)
K = 128 if CUDA else 8
VOCAB = 151_936 if CUDA else 1_000


def assert_top(
    values: torch.Tensor, top: torch.Tensor, ids: torch.Tensor, k: int, kernel: bool = True
) -> None:
    """``top`` holds each row's k largest values, sorted as ``topk`` sorts them, and ``ids``
    are distinct columns holding them (wherever a value is not -inf); from the kernel, ties
    keep the smaller columns, in order."""
    expected, _ = top_candidates_ref(values, k)
    assert top.dtype == torch.float32 and ids.dtype == torch.int64, f"seed {SEED}"
    assert not top.isnan().any(), f"seed {SEED}: NaN in the output"
    assert torch.equal(top, expected), f"seed {SEED}: values differ from topk's"
    finite = top.isfinite() | (top == float("inf"))
    held = values.float().gather(1, ids)
    assert torch.equal(held[finite], top[finite]), f"seed {SEED}: an id does not hold its value"
    for row in range(values.shape[0]):
        row_ids = ids[row][finite[row]]
        assert row_ids.unique().numel() == row_ids.numel(), f"seed {SEED}: row {row} repeats"
    if kernel:
        stable = values.float().sort(dim=1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids[finite], stable[finite]), f"seed {SEED}: ties in another order"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_random_rows_match_topk(dtype, rows):
    values = randn(rows, VOCAB, g=gen(rows), dtype=dtype, scale=4.0)
    with poisoned():
        top, ids = top_candidates_triton(values, K, **SIZES)
    assert_top(values, top, ids, K)


@pytest.fixture(params=[True, False], ids=["histogram", "compares"])
def redo_by_histogram(request, monkeypatch):
    """The exact redo counts a key's bits by ``tl.histogram`` or by compares."""
    import kernels.top_candidates as module

    monkeypatch.setattr(module, "REDO_BY_HISTOGRAM", request.param)
    return request.param


@pytest.mark.usefixtures("redo_by_histogram")
def test_rows_of_few_levels_overflow_their_slots_and_are_redone_exactly():
    g = gen(11)
    rows = 64 if CUDA else 4  # many rows redone at once
    values = torch.randint(0, 3, (rows, VOCAB), generator=g).float()
    values[1] = torch.randint(-5, 5, (VOCAB,), generator=g).float() / 4  # ties in bf16
    values[2, : VOCAB // 2] = 7.0  # half the row equal to its largest value
    for dtype in (torch.float32, torch.bfloat16):
        rows_values = values.to(dtype).to(DEVICE)
        with poisoned():
            top, ids = top_candidates_triton(rows_values, K, **SIZES)
        assert_top(rows_values, top, ids, K)
        # Ties at the k-th value keep the first columns that hold it.
        assert torch.equal(ids[2], torch.arange(K, device=DEVICE)), f"seed {SEED}"


@pytest.mark.usefixtures("redo_by_histogram")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows_redone_exactly_when_their_slots_overflow(dtype):
    """Slots as few as k: rows of distinct values overflow them, and take the redo."""
    values = randn(6, VOCAB, g=gen(17), dtype=dtype, scale=3.0)
    values[3] = -values[3].abs()  # every key negative
    sizes = dict(SIZES, slots=K)
    with poisoned():
        top, ids = top_candidates_triton(values, K, **sizes)
    assert_top(values, top, ids, K)


def test_rows_mostly_minus_inf_and_rows_with_inf():
    g = gen(12)
    values = torch.full((5, VOCAB), float("-inf"))
    values[0, :: VOCAB // 10] = torch.randn(values[0, :: VOCAB // 10].numel(), generator=g)
    values[1, :3] = torch.tensor([1.0, 2.0, 1.0])  # fewer finite values than k
    values[2, 100 : 100 + 5 * K] = torch.randn(5 * K, generator=g)  # one run of columns
    values[3] = torch.randn(VOCAB, generator=g)
    values[3, 17] = float("inf")
    values[4, ::2] = torch.randn(values[4, ::2].numel(), generator=g)  # half the groups empty
    values = values.to(DEVICE)
    with poisoned():
        top, ids = top_candidates_triton(values, K, **SIZES)
    assert_top(values, top, ids, K)
    assert ids[3, 0].item() == 17, f"seed {SEED}"


def test_ties_below_the_overflow_keep_the_smaller_columns_whatever_the_chunking():
    values = randn(4, VOCAB, g=gen(13), dtype=torch.float32)
    kth = values.topk(K, dim=1).values[:, K // 2 : K // 2 + 1]
    tied = torch.randperm(VOCAB, generator=gen(16))[: 3 * K // 4].to(DEVICE)
    values[:, tied] = kth  # ties across the k-th place, spread over the chunks
    first = top_candidates_triton(values, K, **SIZES)
    sizes = dict(SIZES, chunk=SIZES["chunk"] * 2)
    second = top_candidates_triton(values, K, **sizes)
    assert_top(values, *first, K)
    assert torch.equal(first[0], second[0]), f"seed {SEED}"
    assert torch.equal(first[1], second[1]), f"seed {SEED}: other columns with other chunks"


def test_arguments_are_checked():
    values = randn(2, 300, g=gen(14), dtype=torch.float32)
    with pytest.raises(ValueError, match="k must be"):
        top_candidates(values, 0)
    with pytest.raises(ValueError, match="k must be"):
        top_candidates(values, 301)
    with pytest.raises(ValueError, match="rows, vocab"):
        top_candidates(values[0], 4)
    with pytest.raises(ValueError, match="multiple of groups"):
        top_candidates_triton(values, 4, chunk=48, groups=32, slots=64)
    with pytest.raises(ValueError, match="k must be"):
        top_candidates_triton(values, GROUPS + 1)


def test_dispatch_gives_topk_values_on_every_device():
    values = randn(3, 5_000, g=gen(15), dtype=torch.bfloat16)
    top, ids = top_candidates(values, 20)
    assert_top(values, top, ids, 20, kernel=CUDA)
    empty_top, empty_ids = top_candidates(values[:0], 20)
    assert empty_top.shape == (0, 20) and empty_ids.shape == (0, 20)
