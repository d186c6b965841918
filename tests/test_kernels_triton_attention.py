"""Triton paged prefill attention against the reference: the flash-style kernel over shuffled
physical blocks, GQA group sizes 1/4/5/8, block sizes 4/16, prefix-cached chunks, splits over
keys, a mixed graph batch with its work table (the table itself: test_prefill_work.py); on
CUDA also Qwen3-4B shapes. Decode attention: test_kernels_decode_attention.py. Setup and
poisoning: triton_test_util.py; the paged cache: attention_test_util.py.
"""

from __future__ import annotations

import pytest
import torch
from attention_test_util import GQA, QWEN3_4B, build_paged
from triton_test_util import (
    DEVICE,
    SEED,
    check,
    gen,
    gpu_only,
    poisoned,
    randn,
    requires_triton,
)

from kernels.attention import paged_attention_ref, paged_attention_triton
from kernels.prefill_attention import paged_prefill_attention_triton
from kernels.prefill_tiles import MAX_SPLITS, choose_prefill_splits
from kernels.prefill_work import prefill_work_table_triton

pytestmark = requires_triton

PREFILL_CASES = [(13, 13), (9, 1), (21, 6), (7, 3), (1, 1), (16, 1), (40, 29), (32, 8)]


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_attention(num_heads, num_kv_heads, block_size, dtype):
    if dtype == torch.float16 and (block_size, num_kv_heads) != (16, 2):
        pytest.skip("float16 runs one configuration (keeps the interpreter run short)")
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        PREFILL_CASES, num_heads, num_kv_heads, 32, block_size, dtype, SEED + block_size
    )
    scale = 32**-0.5
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 29, 40)
    with poisoned():
        out = paged_attention_triton(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 29, 40)
    check(out, expected, "prefill (mixed batch)")


@pytest.mark.parametrize("open_tiles", [False, True])
def test_prefill_small_tiles_and_chunks_equal_whole_prompt(open_tiles):
    """Tiles smaller than a query's group, several key tiles per query tile, and a prompt
    prefilled in chunks (each chunk attending to the cached prefix) equal one pass; with
    ``open_tiles``, the key tiles before each query tile's diagonal run unmasked."""
    ctx = 45
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        [(ctx, ctx)], 8, 2, 16, 4, torch.float32, SEED + 9
    )
    whole = paged_prefill_attention_triton(
        q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 0, block_m=16, block_n=16,
        open_tiles=open_tiles,
    )  # fmt: skip
    check(whole, paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25), "one")
    pieces, start = [], 0
    for chunk in (16, 5, 20, 4):
        end = start + chunk
        with poisoned():
            piece = paged_prefill_attention_triton(
                q[start:end], k_cache, v_cache, tables,
                torch.tensor([end], dtype=torch.int32, device=DEVICE),
                torch.tensor([0, chunk], dtype=torch.int32, device=DEVICE),
                0.25, chunk, block_m=16, block_n=16, open_tiles=open_tiles,
            )  # fmt: skip
        pieces.append(piece)
        start = end
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("open_tiles", [False, True])
@pytest.mark.parametrize("num_splits", [2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_split_over_keys_equals_one_pass(num_splits, dtype, open_tiles):
    """Splitting the keys of each tile (a short tail over a long cached prefix) gives the
    same result; splits past a tile's causal end, a one-query sequence, padding tokens past
    the batch (not written) and padding sequences with no queries are all covered."""
    cases = [(70, 6), (45, 1), (33, 33)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, 8, 2, 16, 4, dtype, SEED + 11 + num_splits
    )
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 33, 70)
    pad_q = torch.cat([q, randn(3, 8, 16, g=gen(12), dtype=dtype)])
    pad_tables = torch.cat([tables, tables[:1]])
    pad_lens = torch.cat([ctx_lens, torch.zeros_like(ctx_lens[:1])])
    pad_qsl = torch.cat([qsl, qsl[-1:]])
    with poisoned():
        out = paged_prefill_attention_triton(
            pad_q, k_cache, v_cache, pad_tables, pad_lens, pad_qsl, 0.25, 36,
            block_m=16, block_n=16, num_splits=num_splits, open_tiles=open_tiles,
        )  # fmt: skip
    check(out[: q.shape[0]], expected, f"prefill over {num_splits} key splits")
    assert out[q.shape[0] :].isnan().all(), "padding tokens must not be written"


def test_prefill_split_planned_for_one_sequence_of_a_padded_batch():
    """As a captured prefill graph runs it: room for four sequences, one real, a context
    bound far above the real one. Planned for one sequence, the keys split many ways, most
    splits find no key of their sequence, and the result is still exact."""
    cases = [(90, 5)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, 8, 2, 16, 4, torch.float32, SEED + 31
    )
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 5, 90)
    pad_tables = torch.cat([tables, tables.new_zeros((3, tables.shape[1]))])
    pad_lens = torch.cat([ctx_lens, ctx_lens.new_zeros(3)])
    pad_qsl = torch.cat([qsl, qsl[-1:].repeat(3)])
    # Qwen3-4B's 32-token graph: 2 tiles x 8 KV heads for one sequence, or for four.
    assert choose_prefill_splits(2 * 8, 8192, q.device) == MAX_SPLITS
    assert choose_prefill_splits(2 * 8 * 4, 8192, q.device) < MAX_SPLITS
    with poisoned():
        out = paged_prefill_attention_triton(
            q, k_cache, v_cache, pad_tables, pad_lens, pad_qsl, 0.25, 5, 8192,
            block_m=16, block_n=16, split_seqs=1,
        )  # fmt: skip
    check(out, expected, "prefill split for one of four sequence slots")


def test_prefill_graph_batch_of_a_prompt_and_decodes():
    """As a mixed-step graph runs it: a prompt chunk and six decodes in room for ten
    sequences and 48 tokens, the work table built once and passed in, keys split as for one
    sequence. Padding rows stay unwritten."""
    cases = [(3, 1), (40, 1), (70, 19), (5, 1), (1, 1), (64, 1), (33, 1)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, 8, 2, 16, 4, torch.float32, SEED + 7
    )
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 19, 70)
    room, tokens = 10, 48
    pad_q = torch.cat([q, q.new_full((tokens - q.shape[0], *q.shape[1:]), float("nan"))])
    pad_tables = torch.cat([tables, tables.new_zeros((room - len(cases), tables.shape[1]))])
    pad_lens = torch.cat([ctx_lens, ctx_lens.new_zeros(room - len(cases))])
    pad_qsl = torch.cat([qsl, qsl[-1:].repeat(room - len(cases))])
    work = prefill_work_table_triton(pad_qsl, tokens, 16 // 4)
    assert (work >= 0).sum().item() == 6 + 5  # a tile per decode, five for the prompt
    with poisoned():
        out = paged_prefill_attention_triton(
            pad_q, k_cache, v_cache, pad_tables, pad_lens, pad_qsl, 0.25, tokens, 4096,
            block_m=16, block_n=16, split_seqs=1, work_table=work,
        )  # fmt: skip
    check(out[: q.shape[0]], expected, "prompt and decodes in a padded batch")
    assert out[q.shape[0] :].isnan().all(), "padding tokens must not be written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_open_tiles_mixed_batch(dtype):
    """Open key tiles (no causal mask before a query tile's diagonal) over a batch of whole
    prompts, prefix-cached chunks that start mid-block, decode rows and a prompt shorter than
    one key tile, with query tiles of 8 and 4 queries and 16- and 32-key tiles: equal to the
    reference."""
    cases = [(83, 83), (70, 21), (45, 1), (9, 9), (64, 64), (130, 3), (17, 1)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(cases, 8, 2, 16, 4, dtype, SEED + 51)
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 83, 130)
    for block_m, block_n in ((32, 16), (16, 32)):
        with poisoned():
            out = paged_prefill_attention_triton(
                q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 83, 130,
                block_m=block_m, block_n=block_n, open_tiles=True,
            )  # fmt: skip
        check(out, expected, f"open tiles {block_m}x{block_n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_lazy_rescale_mixed_batch(dtype, num_splits):
    """With ``rescale_slack`` the running max moves only when a row's grows past the slack.
    Keys scaled block by block (0.5x to 8x, blocks shuffled along each sequence) make some
    tiles raise it by far more than the slack and others not at all; whole prompts, cached
    chunks, decode rows and key splits all equal the reference."""
    cases = [(83, 83), (70, 21), (45, 1), (9, 9), (130, 3), (17, 1)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(cases, 8, 2, 16, 4, dtype, SEED + 53)
    block_scale = 0.5 + 7.5 * torch.rand(k_cache.shape[0], generator=gen(54))
    k_cache = k_cache * block_scale.to(DEVICE, dtype).view(-1, 1, 1, 1)
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 83, 130)
    with poisoned():
        out = paged_prefill_attention_triton(
            q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 83, 130,
            block_m=16, block_n=16, rescale_slack=8.0, num_splits=num_splits,
        )  # fmt: skip
    check(out, expected, f"lazy rescale, {num_splits} key splits")


def test_prefill_tile_follows_the_longest_query_run(monkeypatch):
    """16-bit steps with a query run of LONG_QUERY_TOKENS or more take the long tile; shorter
    runs, float32 and wide heads keep their tiles; the bound can be moved or turned off, and
    a bad value is an error."""
    from kernels import prefill_tiles as pa

    group, long = 4, pa.LONG_QUERY_TOKENS
    assert pa.prefill_tile(torch.bfloat16, 128, group, long) == pa.LONG_TILE
    assert pa.prefill_tile(torch.float16, 128, group, 16384) == pa.LONG_TILE
    assert pa.prefill_tile(torch.bfloat16, 128, group, long - 1) == pa.SHORT_TILE
    assert pa.prefill_tile(torch.float32, 128, group, 16384).block_m == 32
    assert pa.prefill_tile(torch.bfloat16, 256, group, 16384).block_n == 32
    assert pa.prefill_tile(torch.bfloat16, 128, 128, 64).block_m == 128  # one whole group
    for value, expected in (("0", pa.SHORT_TILE), ("512", pa.LONG_TILE)):
        monkeypatch.setenv("PEGAINFER_PREFILL_LONG_QUERIES", value)
        pa.long_query_tokens.cache_clear()
        assert pa.prefill_tile(torch.bfloat16, 128, group, 1024) == expected, value
    monkeypatch.setenv("PEGAINFER_PREFILL_LONG_QUERIES", "many")
    pa.long_query_tokens.cache_clear()
    with pytest.raises(ValueError, match="PEGAINFER_PREFILL_LONG_QUERIES"):
        pa.prefill_tile(torch.bfloat16, 128, group, 1024)
    monkeypatch.delenv("PEGAINFER_PREFILL_LONG_QUERIES")
    pa.long_query_tokens.cache_clear()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_prefill_program_order_gives_the_same_bits(num_splits):
    """The KV heads fastest or slowest in the grid: each program computes the same tile, so
    the outputs are the same bits (split over keys too)."""
    cases = [(40, 29), (70, 6), (13, 13)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, 8, 2, 16, 4, torch.bfloat16, SEED + 41
    )
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 29, 70)
    outs = []
    for heads_fastest in (False, True):
        with poisoned():
            outs.append(
                paged_prefill_attention_triton(
                    q,
                    k_cache,
                    v_cache,
                    tables,
                    ctx_lens,
                    qsl,
                    0.25,
                    29,
                    70,
                    block_m=16,
                    block_n=16,
                    num_splits=num_splits,
                    heads_fastest=heads_fastest,
                )
            )
    check(outs[1], expected, f"prefill, heads fastest, {num_splits} splits")
    assert torch.equal(outs[0], outs[1])


def test_heads_fastest_for_few_query_tiles_or_keys_that_fit_l2():
    from kernels.prefill_tiles import heads_fastest

    per_token = 2 * 8 * 128 * 2  # Qwen3-4B's keys and values a token, one layer: 4 KiB
    assert heads_fastest(1024, 0, per_token)  # a prefill graph: max_context_len unknown
    assert heads_fastest(1024, 40960, per_token)  # a short tail after a long prefix
    assert heads_fastest(8192, 8192, per_token)  # 32 MiB of keys and values
    assert not heads_fastest(16384, 16384, per_token)
    assert not heads_fastest(4096, 16384, per_token)
    assert not heads_fastest(16384, 0, per_token)  # the context holds the queries at least


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_sixteen_splits_twice(dtype):
    """16 key splits and their merge: odd contexts, several sequences, GQA over two KV
    heads, splits with no key of their tile; a second launch on the same scratch, with new
    queries, is exact too."""
    cases = [(301, 7), (211, 1), (97, 4)]
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(cases, 8, 2, 16, 4, dtype, SEED + 41)
    for attempt in range(2):
        if attempt:
            q = randn(*q.shape, g=gen(42), dtype=dtype)
        expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 7, 301)
        with poisoned():
            out = paged_prefill_attention_triton(
                q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 7, 301,
                block_m=16, block_n=16, num_splits=16,
            )  # fmt: skip
        check(out, expected, f"prefill, 16 splits, launch {attempt}")


# --------------------------------------------------------------------------- realistic (GPU)


@gpu_only
@pytest.mark.parametrize(
    "cases,split_seqs",
    [
        ([(2048, 2048)], 0),
        ([(6000, 2500), (3000, 3000), (900, 1)], 0),  # the long tile, a prefix, a decode
        ([(4096, 1024), (600, 600), (300, 1)], 0),
        ([(4096, 32)], 0),
        ([(16384, 32)], 0),
        ([(4096, 32), (100, 20)], 1),  # a prefill graph's plan: split for one sequence
    ],
)
def test_prefill_attention_qwen3_4b_shapes(cases, split_seqs):
    q, k_cache, v_cache, tables, ctx_lens, qsl = build_paged(
        cases, **QWEN3_4B, block_size=16, dtype=torch.bfloat16, seed=SEED
    )
    scale = 128**-0.5
    max_q, max_c = max(c[1] for c in cases), max(c[0] for c in cases)
    expected = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, max_q, max_c)
    # A split plan for one sequence sizes its grid from the model's context bound.
    bound = 40960 if split_seqs else max_c
    with poisoned():
        out = paged_attention_triton(
            q, k_cache, v_cache, tables, ctx_lens, qsl, scale, max_q, bound, split_seqs
        )
    check(out, expected, "prefill")


def test_block_table_width_compiles_no_new_variant():
    """An eager batch's block tables are as wide as its longest context; a specialized row
    stride compiled a new kernel variant mid-serving whenever that width turned a multiple
    of 16 (0.7 s for one batch on an H200)."""
    from kernels import decode_attention, prefill_attention

    for kernel in (prefill_attention._prefill_kernel, decode_attention._decode_split_kernel):
        fn = getattr(kernel, "fn", kernel)  # the Python function, before or after binding
        assert "stride_table_seq" in fn.__pegainfer_do_not_specialize__
