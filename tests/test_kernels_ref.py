"""The kernel references against straightforward formulas, on random inputs."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.attention import paged_attention, paged_attention_ref, store_kv, store_kv_ref
from kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from kernels.rotary import rotary_embedding, rotary_embedding_ref


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- attention


def naive_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense attention in float64 for one sequence: ``q [Q, H, D]`` are the last Q of the
    ``k, v [C, Hkv, D]`` positions; plain loops over heads, explicit softmax."""
    q, k, v = q.double(), k.double(), v.double()
    num_queries, num_heads, _ = q.shape
    context = k.shape[0]
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    for h in range(num_heads):
        scores = q[:, h] @ k[:, h // group].T * scale  # [Q, C]
        for r in range(num_queries):
            position = context - num_queries + r
            scores[r, position + 1 :] = float("-inf")
        weights = torch.exp(scores - scores.max(dim=1, keepdim=True).values)
        weights = weights / weights.sum(dim=1, keepdim=True)
        out[:, h] = weights @ v[:, h // group]
    return out


def _build_paged_case(
    cases: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
):
    """Random K/V for every token of every sequence, written into a NaN-filled paged cache
    through shuffled physical blocks; ``cases`` is ``(context_len, query_len)`` per seq."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in cases]
    num_blocks = sum(blocks_needed) + 3
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # NaN everywhere not written: any read of an unwritten slot poisons the output.
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables, full_k, full_v, queries = [], [], [], []
    for (ctx, qlen), count in zip(cases, blocks_needed):
        table = [physical.pop() for _ in range(count)]
        tables.append(table)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        )
        store_kv_ref(k, v, k_cache, v_cache, slots)
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(qlen, num_heads, head_dim, generator=gen).to(dtype))
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32
    )
    context_lens = torch.tensor([c for c, _ in cases], dtype=torch.int32)
    starts = [0]
    for _, qlen in cases:
        starts.append(starts[-1] + qlen)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    q = torch.cat(queries)
    return q, k_cache, v_cache, block_tables, context_lens, query_start_loc, full_k, full_v, queries


# (context_len, query_len): prefill, decode, prefix-cached prefill, chunk ending mid-block,
# single-token prompt, decode on a block boundary.
MIXED_CASES = [(13, 13), (9, 1), (21, 6), (7, 3), (1, 1), (16, 1), (30, 30)]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_matches_dense_causal(num_heads, num_kv_heads, block_size):
    head_dim = 16
    scale = head_dim**-0.5
    q, k_cache, v_cache, tables, ctx_lens, qsl, full_k, full_v, queries = _build_paged_case(
        MIXED_CASES, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=block_size
    )
    out = paged_attention(q, k_cache, v_cache, tables, ctx_lens, qsl, scale, 30, 30)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert not out.isnan().any()
    starts = qsl.tolist()
    for i in range(len(MIXED_CASES)):
        expected = naive_causal_attention(queries[i], full_k[i], full_v[i], scale)
        assert rel_err(out[starts[i] : starts[i + 1]], expected) < 1e-5, f"sequence {i}"


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_batched_decode_path_matches_dense(dtype, tol):
    """Decode-only batches take the batched path: NaN-poisoned unwritten slots, contexts
    ending mid-block and on block boundaries, GQA, several chunks."""
    cases = [(ctx, 1) for ctx in (1, 4, 5, 17, 32, 9, 3, 28)]
    q, k_cache, v_cache, tables, ctx_lens, qsl, full_k, full_v, queries = _build_paged_case(
        cases, 8, 2, 16, 4, dtype, seed=11
    )
    import kernels.attention as attention_module

    chunk = attention_module._DECODE_CHUNK_ELEMENTS
    try:
        attention_module._DECODE_CHUNK_ELEMENTS = 3 * 32 * 2 * 16  # 3 sequences a chunk
        out = paged_attention(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25, 1, 32)
    finally:
        attention_module._DECODE_CHUNK_ELEMENTS = chunk
    assert not out.isnan().any()
    for i in range(len(cases)):
        expected = naive_causal_attention(queries[i], full_k[i], full_v[i], 0.25)
        assert rel_err(out[i : i + 1], expected) < tol, f"sequence {i}"
    looped = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 0.25)
    torch.testing.assert_close(out, looped, rtol=tol, atol=tol)


def test_paged_attention_bfloat16_close_to_float64():
    q, k_cache, v_cache, tables, ctx_lens, qsl, full_k, full_v, queries = _build_paged_case(
        MIXED_CASES, 8, 2, 32, 8, torch.bfloat16, seed=3
    )
    out = paged_attention_ref(q, k_cache, v_cache, tables, ctx_lens, qsl, 32**-0.5)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    starts = qsl.tolist()
    for i in range(len(MIXED_CASES)):
        expected = naive_causal_attention(queries[i], full_k[i], full_v[i], 32**-0.5)
        assert rel_err(out[starts[i] : starts[i + 1]], expected) < 1e-2


def test_paged_attention_prefill_in_chunks_equals_whole_prefill():
    """A prompt processed in chunks attends exactly like the same prompt in one go."""
    ctx = 23
    q, k_cache, v_cache, tables, _, _, _, _, queries = _build_paged_case(
        [(ctx, ctx)], 4, 2, 16, 4, torch.float32, seed=7
    )
    whole = paged_attention(
        q,
        k_cache,
        v_cache,
        tables,
        torch.tensor([ctx], dtype=torch.int32),
        torch.tensor([0, ctx], dtype=torch.int32),
        0.25,
    )
    pieces, start = [], 0
    for chunk in (5, 5, 5, 5, 3):
        end = start + chunk
        pieces.append(
            paged_attention(
                q[start:end],
                k_cache,
                v_cache,
                tables,
                torch.tensor([end], dtype=torch.int32),
                torch.tensor([0, chunk], dtype=torch.int32),
                0.25,
            )
        )
        start = end
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=1e-5, atol=1e-6)


def test_paged_attention_rejects_bad_grouping():
    q = torch.randn(2, 3, 8)
    cache = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError):
        paged_attention_ref(
            q,
            cache,
            cache,
            torch.zeros(1, 1, dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
            torch.tensor([0, 2], dtype=torch.int32),
            1.0,
        )


def test_store_kv_writes_slots_and_skips_padding():
    num_blocks, block_size, heads, dim = 5, 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, heads, dim)
    v_cache = torch.zeros(num_blocks, block_size, heads, dim)
    k = torch.randn(4, heads, dim)
    v = torch.randn(4, heads, dim)
    slots = torch.tensor([9, -1, 0, 19])
    store_kv(k, v, k_cache, v_cache, slots)
    flat_k = k_cache.view(-1, heads, dim)
    flat_v = v_cache.view(-1, heads, dim)
    for token, slot in ((0, 9), (2, 0), (3, 19)):
        torch.testing.assert_close(flat_k[slot], k[token], rtol=0, atol=0)
        torch.testing.assert_close(flat_v[slot], v[token], rtol=0, atol=0)
    written = {9, 0, 19}
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0


# --------------------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_formula(dtype, tol):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(7, 96, generator=gen)).to(dtype)
    weight = torch.randn(96, generator=gen).to(dtype)
    eps = 1e-6
    x64 = x.double()
    expected = x64 / torch.sqrt((x64**2).mean(-1, keepdim=True) + eps) * weight.double()
    out = rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, expected) < tol
    # Works on any leading shape (per-head norms of Qwen3 use [T, heads, head_dim]).
    out3 = rms_norm_ref(x.view(7, 6, 16), weight[:16], eps)
    x3 = x64.view(7, 6, 16)
    expected3 = x3 / torch.sqrt((x3**2).mean(-1, keepdim=True) + eps) * weight[:16].double()
    assert rel_err(out3, expected3) < tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_add_rms_norm_matches_unfused(dtype, tol):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = torch.randn(5, 64, generator=gen).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    summed = x.double() + residual.double()
    expected = summed / torch.sqrt((summed**2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert rel_err(new_residual, summed) < tol
    assert rel_err(normed, expected) < tol
    assert normed.dtype == dtype and new_residual.dtype == dtype
    # The norm is taken of exactly the residual handed on.
    torch.testing.assert_close(normed, fused_add_rms_norm_ref(x, residual, weight, 1e-5)[0])
    torch.testing.assert_close(normed, rms_norm_ref(new_residual, weight, 1e-5))


# --------------------------------------------------------------------------- rotary


def _cos_sin(max_pos: int, rotary_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.arange(max_pos, dtype=torch.float64).unsqueeze(1) * inv_freq
    return angles.cos().float(), angles.sin().float(), angles


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rotary_matches_complex_rotation(dtype, tol):
    head_dim, max_pos = 32, 64
    cos, sin, angles = _cos_sin(max_pos, head_dim)
    gen = torch.Generator().manual_seed(2)
    positions = torch.randint(0, max_pos, (9,), generator=gen)
    q = torch.randn(9, 4, head_dim, generator=gen).to(dtype)
    k = torch.randn(9, 2, head_dim, generator=gen).to(dtype)
    q_out, k_out = rotary_embedding(positions, q, k, cos, sin)

    def expected(x: torch.Tensor) -> torch.Tensor:
        # NeoX pairs element i with element i + head_dim/2: one complex number per pair.
        half = head_dim // 2
        x64 = x.double()
        z = torch.complex(x64[..., :half], x64[..., half:])
        z = z * torch.polar(torch.ones_like(angles[positions]), angles[positions]).unsqueeze(1)
        return torch.cat((z.real, z.imag), dim=-1)

    assert q_out.dtype == dtype and k_out.shape == k.shape
    assert rel_err(q_out, expected(q)) < tol
    assert rel_err(k_out, expected(k)) < tol
    # Position 0 is the identity.
    zero = torch.zeros(1, dtype=torch.long)
    q0, _ = rotary_embedding_ref(zero, q[:1], k[:1], cos, sin)
    torch.testing.assert_close(q0, q[:1])


def test_rotary_partial_dim_passes_the_rest_through():
    cos, sin, _ = _cos_sin(16, 8)
    q = torch.randn(3, 2, 16)
    k = torch.randn(3, 1, 16)
    positions = torch.tensor([1, 5, 9])
    q_out, k_out = rotary_embedding_ref(positions, q, k, cos, sin)
    torch.testing.assert_close(q_out[..., 8:], q[..., 8:], rtol=0, atol=0)
    assert not torch.allclose(q_out[..., :8], q[..., :8])
    torch.testing.assert_close(q_out.norm(dim=-1), q.norm(dim=-1))


# --------------------------------------------------------------------------- activation


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_silu_and_mul_matches_formula(dtype, tol):
    gen = torch.Generator().manual_seed(4)
    x = (2 * torch.randn(6, 2 * 40, generator=gen)).to(dtype)
    gate, up = x.double()[:, :40], x.double()[:, 40:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = silu_and_mul(x)
    assert out.shape == (6, 40) and out.dtype == dtype
    assert rel_err(out, expected) < tol
    torch.testing.assert_close(
        silu_and_mul_ref(x.float()), F.silu(x.float()[:, :40]) * x.float()[:, 40:]
    )


def test_reference_outputs_are_finite_at_extremes():
    x = torch.tensor([[1e4, -1e4, 0.0, 1e-8] * 4])
    assert torch.isfinite(rms_norm(x, torch.ones(16), 1e-6)).all()
    assert torch.isfinite(silu_and_mul(torch.tensor([[-100.0, 100.0, 3.0, 4.0]]))).all()
    assert math.isfinite(rms_norm(torch.zeros(1, 8), torch.ones(8), 1e-6).sum().item())
