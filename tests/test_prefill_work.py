"""The prefill attention kernel's work table (kernels/prefill_work.py): the Triton build
against its torch reference and a plain Python one, on batches with empty sequences, graph
padding and more sequences than one program scans at once; the size check, and a table
built for other tiles refused by the attention kernel."""

from __future__ import annotations

import random

import pytest
import torch
from triton_test_util import DEVICE, SEED, requires_triton

from kernels.prefill_attention import paged_prefill_attention_triton
from kernels.prefill_work import (
    prefill_queries_per_tile,
    prefill_work_table,
    prefill_work_table_ref,
    prefill_work_table_triton,
)

pytestmark = requires_triton


def _work_table_reference(query_lens: list[int], num_tokens: int, per_tile: int) -> list[int]:
    entries = []
    for seq, query_len in enumerate(query_lens):
        tiles = -(-query_len // per_tile)
        entries += [seq << 16 | tile for tile in reversed(range(tiles))]
    size = -(-num_tokens // per_tile) + len(query_lens)
    return entries + [-1] * (size - len(entries))


@pytest.mark.parametrize(
    "query_lens,num_tokens,per_tile",
    [
        ([100], 100, 16),  # one prompt: its tiles last-first, one entry to spare
        ([1] * 30 + [1000], 1030, 16),  # a prompt beside thirty decodes
        ([17, 0, 1, 32, 0], 50, 16),  # empty sequences take no tile
        ([5, 3, 0, 0], 1280, 16),  # a graph's batch: tokens and sequences of room to spare
        ([33], 33, 1),
        ([], 8, 16),
    ],
)
def test_prefill_work_table(query_lens, num_tokens, per_tile):
    """Both builds give the plain Python table; the dispatch picks one by device."""
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    expected = _work_table_reference(query_lens, num_tokens, per_tile)
    for build in (prefill_work_table_ref, prefill_work_table_triton, prefill_work_table):
        table = build(query_start_loc, num_tokens, per_tile)
        assert table.dtype == torch.int32 and table.device == query_start_loc.device
        assert table.tolist() == expected, build.__name__


def test_prefill_work_table_of_many_sequences_matches_reference():
    """Past one program's entries and one step's sequences: random lengths, zeros among
    them, room to spare as in a captured graph."""
    rng = random.Random(SEED)
    query_lens = [rng.choice([0, 1, 1, 1, 2, 17, 64, 300]) for _ in range(150)]
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    starts += [starts[-1]] * 20
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    num_tokens = starts[-1] + 37
    got = prefill_work_table_triton(query_start_loc, num_tokens, 16)
    assert torch.equal(got, prefill_work_table_ref(query_start_loc, num_tokens, 16)), SEED


def test_prefill_work_table_limits_and_shape_check():
    one = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="work table"):
        prefill_work_table_triton(one, 1 << 20, 16)
    assert prefill_queries_per_tile(torch.bfloat16, 128, 4, 1024) == 16  # 64-row tiles, 4 heads
    assert prefill_queries_per_tile(torch.bfloat16, 128, 4, 4096) == 32  # the long tile
    g = torch.Generator().manual_seed(SEED)
    q = torch.randn(4, 8, 16, generator=g).to(DEVICE)
    k_cache = torch.randn(3, 4, 2, 16, generator=g).to(DEVICE)
    v_cache = torch.randn(3, 4, 2, 16, generator=g).to(DEVICE)
    tables = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=DEVICE)
    ctx_lens = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    wrong = prefill_work_table_ref(qsl, 4, 1)  # built for another tile
    with pytest.raises(ValueError, match="work table of shape"):
        paged_prefill_attention_triton(
            q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 4, 9, work_table=wrong
        )
