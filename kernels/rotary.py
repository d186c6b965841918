"""Rotary position embedding, NeoX style (the two halves of each head are the pairs).

The cos/sin caches are float32 ``[max_positions, rotary_dim // 2]``, built once by the
rotary layer; the rotation is computed in float32 and cast back.

``rotary_and_store_kv`` fuses the rotation with the KV-cache write: one Triton program per
token rotates its q and k heads and writes the rotated k and the v to the token's slot, so
the rotated k never makes a round trip through memory. With ``qk_norm`` (Qwen3's per-head
RMSNorm of q and k before rope) the same program normalises each head first, so the norm
costs no launch of its own.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.attention import store_kv_ref
from kernels.backend import (
    load_triton,
    next_power_of_2,
    triton_jit,
    use_pdl,
    use_triton,
)
from kernels.rmsnorm import rms_norm_ref

tl = None  # bound to triton.language by kernels.backend.load_triton()

# q heads one program rotates. A program per token for all heads left a decode batch of a
# few tokens on a few SMs, each running one long chain of loads.
Q_HEADS_PER_PROGRAM = 8

# (q_norm weight [head_dim], k_norm weight [head_dim], eps): per-head RMSNorm before rope.
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, 1, rotary_dim // 2]
    rotary_dim = cos.shape[-1] * 2
    x32 = x.float()
    x_rot, x_pass = x32[..., :rotary_dim], x32[..., rotary_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if x_pass.shape[-1]:
        rotated = torch.cat((rotated, x_pass), dim=-1)
    return rotated.to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, num_heads, head_dim]`` and ``k [T, num_kv_heads, head_dim]`` by the
    angles of ``positions [T]``. Returns new tensors; callers use the return values, which
    leaves a Triton variant free to work in place."""
    cos = cos_cache.index_select(0, positions).unsqueeze(1)
    sin = sin_cache.index_select(0, positions).unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def rotary_and_store_kv_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """Rotate ``q`` and ``k``, write the rotated ``k`` and ``v [T, num_kv_heads, head_dim]``
    to their cache slots (negative slot: skipped), and return the rotated ``q``. With
    ``qk_norm``, q and k are RMS-normalised per head first (rounded to their dtype)."""
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    q_rot, k_rot = rotary_embedding_ref(positions, q, k, cos_cache, sin_cache)
    store_kv_ref(k_rot, v, k_cache, v_cache, slot_mapping)
    return q_rot


@triton_jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    stride_src_head,
    stride_dst_head,
    head_mask,
    cos,
    sin,
    half,
    head_dim,
    norm_w1,
    norm_w2,
    eps,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    NORM: tl.constexpr,
):
    """Rotate ``HEADS`` heads of one token (NeoX: element i pairs with i + half) from
    ``src_ptr`` to ``dst_ptr``; dims past the rotary part are copied through."""
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HALF)
    mask = head_mask[:, None] & (dims < half)[None, :]
    src = src_ptr + heads[:, None] * stride_src_head + dims[None, :]
    dst = dst_ptr + heads[:, None] * stride_dst_head + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    in_ty = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        # Only with full rotary (PASS == 0): the two halves are the whole head.
        mean_square = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim
        inv_rms = tl.rsqrt(mean_square + eps)[:, None]
        # Rounded to the input dtype as the separate norm's output would be.
        x1 = (x1 * inv_rms * norm_w1[None, :]).to(in_ty).to(tl.float32)
        x2 = (x2 * inv_rms * norm_w2[None, :]).to(in_ty).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_ty), mask=mask)
    tl.store(dst + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_ty), mask=mask)
    if PASS > 0:
        rest = tl.arange(0, PASS)
        rest_mask = head_mask[:, None] & (rest < head_dim - 2 * half)[None, :]
        offset = 2 * half + rest[None, :]
        kept = tl.load(
            src_ptr + heads[:, None] * stride_src_head + offset, mask=rest_mask, other=0.0
        )
        tl.store(
            dst_ptr + heads[:, None] * stride_dst_head + offset, kept.to(out_ty), mask=rest_mask
        )


@triton_jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cos,
    stride_cache_slot,
    stride_cache_head,
    num_heads,
    num_kv_heads,
    half,
    head_dim,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    PASS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STORE_KV: tl.constexpr,
    NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    # Grid (tokens, q head groups + 1): programs below the last of a token each rotate
    # Q_HEADS of its q heads; the last rotates its k heads and writes k and v to the cache.
    # Short programs, many of them: a decode batch of a few tokens still spreads over the SMs.
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    is_q = part < tl.num_programs(1) - 1
    # Positions, slots, the angle tables and the norm weights are written before the step's
    # first kernel: read before the wait (kernels/pdl.py), their chain of loads (position,
    # then its angles) overlaps the projection before instead of following it.
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dims < half, other=0.0)
    sin = tl.load(sin_ptr + position * stride_cos + dims, mask=dims < half, other=0.0)
    norm_w1 = cos
    norm_w2 = sin
    if NORM:
        norm_ptr = tl.where(is_q, q_norm_ptr, k_norm_ptr)
        norm_w1 = tl.load(norm_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)
        norm_w2 = tl.load(norm_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)
    if STORE_KV:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if is_q:
        first_head = part * Q_HEADS
        _rotate_heads(
            q_ptr + token * stride_q_token + first_head * stride_q_head,
            q_out_ptr + token * num_heads * head_dim + first_head * head_dim,
            stride_q_head,
            head_dim,
            first_head + tl.arange(0, Q_HEADS) < num_heads,
            cos,
            sin,
            half,
            head_dim,
            norm_w1,
            norm_w2,
            eps,
            Q_HEADS,
            HALF,
            PASS,
            NORM,
        )
    else:
        # This token's k heads into the cache (or k_out), and its v heads copied there.
        kv_heads = tl.arange(0, KV_HEADS)
        kv_mask = kv_heads < num_kv_heads
        if STORE_KV:
            # A negative slot is a padding token: no head is written.
            kv_mask = kv_heads < tl.where(slot >= 0, num_kv_heads, 0)
            k_dst = k_cache_ptr + slot * stride_cache_slot
            k_dst_head_stride = stride_cache_head
        else:
            k_dst = k_out_ptr + token * num_kv_heads * head_dim
            k_dst_head_stride = head_dim
        _rotate_heads(
            k_ptr + token * stride_k_token,
            k_dst,
            stride_k_head,
            k_dst_head_stride,
            kv_mask,
            cos,
            sin,
            half,
            head_dim,
            norm_w1,
            norm_w2,
            eps,
            KV_HEADS,
            HALF,
            PASS,
            NORM,
        )
        if STORE_KV:
            full = tl.arange(0, HEAD_DIM)
            v_mask = kv_mask[:, None] & (full < head_dim)[None, :]
            v = tl.load(
                v_ptr + token * stride_v_token + kv_heads[:, None] * stride_v_head + full[None, :],
                mask=v_mask,
                other=0.0,
            )
            v_dst = v_cache_ptr + slot * stride_cache_slot + kv_heads[:, None] * stride_cache_head
            tl.store(v_dst + full[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = cos_cache.shape[-1]
    if 2 * half > head_dim:
        raise ValueError(f"rotary dim {2 * half} exceeds head_dim {head_dim}")
    if cos_cache.stride() != sin_cache.stride() or cos_cache.stride(-1) != 1:
        cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    store = k_cache is not None
    k_out = None if store else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    load_triton()
    if store:
        assert v is not None and v_cache is not None and slot_mapping is not None
        v = _unit_last_stride(v)
        if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("k_cache and v_cache need the same layout with unit last stride")
        # [blocks, block_size, heads, dim] with the block and offset dims mergeable: slots.
        cache_slot_stride, cache_head_stride = k_cache.stride(1), k_cache.stride(2)
        if k_cache.stride(0) != k_cache.shape[1] * cache_slot_stride:
            raise ValueError("KV cache blocks must be laid out back to back")
        v_arg, v_strides = v, (v.stride(0), v.stride(1))
    else:
        v_arg, v_strides = k, (0, 0)
        cache_slot_stride = cache_head_stride = 0
    rotary_dim = 2 * half
    pass_dim = head_dim - rotary_dim
    if qk_norm is not None and pass_dim:
        raise ValueError("the fused q/k norm needs rotary over the whole head")
    q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    q_heads_per_program = min(Q_HEADS_PER_PROGRAM, next_power_of_2(num_heads))
    grid = (num_tokens, -(-num_heads // q_heads_per_program) + 1)
    with_pdl = use_pdl(q)
    _rotary_kernel[grid](
        positions,
        q,
        k,
        v_arg,
        cos_cache,
        sin_cache,
        q_out,
        k_out if k_out is not None else q_out,
        k_cache if store else q_out,
        v_cache if store else q_out,
        slot_mapping if store else positions,
        q_norm,
        k_norm,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v_strides[0],
        v_strides[1],
        cos_cache.stride(0),
        cache_slot_stride,
        cache_head_stride,
        num_heads,
        num_kv_heads,
        half,
        head_dim,
        Q_HEADS=q_heads_per_program,
        KV_HEADS=next_power_of_2(num_kv_heads),
        HALF=next_power_of_2(half),
        PASS=next_power_of_2(pass_dim) if pass_dim else 0,
        HEAD_DIM=next_power_of_2(head_dim),
        STORE_KV=store,
        NORM=qk_norm is not None,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "rotary"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return q_out, k_out


def rotary_embedding_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = _launch_rotary(positions, q, k, None, cos_cache, sin_cache, None, None, None)
    assert k_out is not None
    return q_out, k_out


def rotary_and_store_kv_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    q_out, _ = _launch_rotary(
        positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, qk_norm
    )
    return q_out


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return rotary_embedding_triton(positions, q, k, cos_cache, sin_cache)
    return rotary_embedding_ref(positions, q, k, cos_cache, sin_cache)


def rotary_and_store_kv(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    qk_norm: QKNorm | None = None,
) -> torch.Tensor:
    """Rotary embedding of ``q``/``k`` (after the per-head ``qk_norm``, if given) fused with
    the cache write of ``k``/``v``; returns the rotated ``q [T, num_heads, head_dim]``. The
    rotated ``k`` lives only in the cache."""
    fn = rotary_and_store_kv_triton if use_triton(q) else rotary_and_store_kv_ref
    return fn(positions, q, k, v, cos_cache, sin_cache, k_cache, v_cache, slot_mapping, qk_norm)
