"""The body of the skinny GEMM's kernels (kernels/skinny_gemm.py): one program's tile of
``BLOCK_N`` output features over one split of K, the merge of the splits by the last to
arrive, and the epilogues (bias, silu-and-mul, the pending norm of kernels/pending_norm.py).
"""

from __future__ import annotations

from kernels import attention_merge, pdl, pending_norm
from kernels.backend import triton_jit

tl = None  # bound to triton.language by kernels.backend.load_triton()


@triton_jit
def _tile_dot(
    acc,
    x_rows,
    w_rows,
    w_mask,
    k_begin,
    k_end,
    K,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    W_EVICT: tl.constexpr,
    MASK_W: tl.constexpr,
):
    """``acc += w[features, k_begin:k_end] @ x[rows, k_begin:k_end].T``; with ``MASK_W`` the
    weight rows off ``w_mask`` ([BLOCK_N, 1]) are not read."""
    for k_start in range(k_begin, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_rows, w_mask, ks, K, EVEN_K, W_EVICT, MASK_W)
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :])
        else:
            x = tl.load(x_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        if DOT_FP32:
            w = w.to(tl.float32)
            x = x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton_jit
def _weight_tile(
    w_rows,
    w_mask,
    ks,
    K,
    EVEN_K: tl.constexpr,
    W_EVICT: tl.constexpr,
    MASK_W: tl.constexpr,
):
    """The ``[BLOCK_N, BLOCK_K]`` weight tile at ``ks``; masked rows (``MASK_W``) are zero
    and cost no memory traffic."""
    if EVEN_K:
        if MASK_W:
            return tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy=W_EVICT)
        return tl.load(w_rows + ks[None, :], eviction_policy=W_EVICT)
    mask = (ks < K)[None, :]
    if MASK_W:
        mask = mask & w_mask
    return tl.load(w_rows + ks[None, :], mask=mask, other=0.0, eviction_policy=W_EVICT)


@triton_jit
def _split_tile(rows, k_begin, index, k_end, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
    ks = k_begin + index * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(rows + ks[None, :], mask=(ks < k_end)[None, :], other=0.0, eviction_policy=EVICT)


@triton_jit
def _split_weight_tile(
    w_rows,
    w_mask,
    k_begin,
    index,
    k_end,
    BLOCK_K: tl.constexpr,
    EVICT: tl.constexpr,
    MASK_W: tl.constexpr,
):
    ks = k_begin + index * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (ks < k_end)[None, :]
    if MASK_W:
        mask = mask & w_mask
    return tl.load(w_rows + ks[None, :], mask=mask, other=0.0, eviction_policy=EVICT)


@triton_jit
def _prefetched_dot(
    acc, w, x_rows, k_begin, index, k_end, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr
):
    x = _split_tile(x_rows, k_begin, index, k_end, BLOCK_K, "")
    if DOT_FP32:
        w = w.to(tl.float32)
        x = x.to(tl.float32)
    return tl.dot(w, tl.trans(x), acc)


@triton_jit
def _tile_dot_pair(
    acc,
    up_acc,
    x_rows,
    w_rows,
    up_rows,
    w_mask,
    k_begin,
    k_end,
    K,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    W_EVICT: tl.constexpr,
    MASK_W: tl.constexpr,
):
    """``_tile_dot`` of the gate rows and the up rows in one K loop: each activation tile is
    read once for both, and one load pipeline runs from the first K step to the last."""
    for k_start in range(k_begin, k_end, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K)
        w = _weight_tile(w_rows, w_mask, ks, K, EVEN_K, W_EVICT, MASK_W)
        up_w = _weight_tile(up_rows, w_mask, ks, K, EVEN_K, W_EVICT, MASK_W)
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :])
        else:
            x = tl.load(x_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        if DOT_FP32:
            w = w.to(tl.float32)
            up_w = up_w.to(tl.float32)
            x = x.to(tl.float32)
        x_t = tl.trans(x)
        acc = tl.dot(w, x_t, acc)
        up_acc = tl.dot(up_w, x_t, up_acc)
    return acc, up_acc


@triton_jit
def _sum_splits_in_order(acc, partial_ptr, tile_offsets, split, num_splits, split_stride):
    """The tile's sum over every split: ``acc`` (this split's) and the others' partials
    (read past L1), added in split order whichever split arrives last, so that the result
    has the same bits on every launch (float addition is not associative)."""
    total = tl.zeros_like(acc)
    for other in range(0, num_splits):
        if other == split:
            total += acc
        else:
            total += tl.load(
                partial_ptr + other * split_stride + tile_offsets, cache_modifier=".cg"
            )
    return total


@triton_jit
def skinny_gemm_tile(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counters_ptr,
    norm_w_ptr,
    weighted_ptr,
    in_sums_ptr,
    residual_ptr,
    out_sums_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_x_row,
    stride_w_row,
    stride_out_row,
    num_in_groups,
    eps,
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    NORMED: tl.constexpr,
    IN_GROUPS: tl.constexpr,
    ADD_NORM: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
    USE_PDL: tl.constexpr,
    PAIRED: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
    PREFETCH_TILES: tl.constexpr,
    W_EVICT: tl.constexpr,
    BALANCED: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if BALANCED:
        # Programs own N / num_programs features each, within a tile of BLOCK_N.
        first = (tile * N) // tl.num_programs(0)
        end = ((tile + 1) * N) // tl.num_programs(0)
    else:
        first = tile * BLOCK_N
        end = N
    features = first + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    feature_mask = features < end
    row_mask = rows < M
    # Padding rows re-read valid ones (clamped) and are never stored, so their loads need no
    # mask; so do the padding features of a tile past N. A balanced program's padding
    # features are masked instead: they are most of a tile, and would read its neighbours'.
    w_mask = feature_mask[:, None]
    safe_features = tl.where(feature_mask, features, 0).to(tl.int64)
    safe_rows = tl.where(row_mask, rows, 0).to(tl.int64)
    w_rows = w_ptr + safe_features[:, None] * stride_w_row
    x_rows = x_ptr + safe_rows[:, None] * stride_x_row
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # Weights are written before the step: the split's first tiles may be read before the wait.
    if PREFETCH_TILES >= 1:
        w_0 = _split_weight_tile(w_rows, w_mask, k_begin, 0, k_end, BLOCK_K, W_EVICT, BALANCED)
    if PREFETCH_TILES >= 2:
        w_1 = _split_weight_tile(w_rows, w_mask, k_begin, 1, k_end, BLOCK_K, W_EVICT, BALANCED)
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    if NORMED:
        square_sums = pending_norm.load_square_sums(
            in_sums_ptr, rows, row_mask, num_in_groups, num_in_groups, IN_GROUPS
        )

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SILU_MUL:
        up_acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if PAIRED:
            acc, up_acc = _tile_dot_pair(
                acc,
                up_acc,
                x_rows,
                w_rows,
                w_rows + N * stride_w_row,
                w_mask,
                k_begin,
                k_end,
                K,
                BLOCK_K,
                EVEN_K,
                DOT_FP32,
                W_EVICT,
                BALANCED,
            )
        else:
            acc = _tile_dot(
                acc,
                x_rows,
                w_rows,
                w_mask,
                k_begin,
                k_end,
                K,
                BLOCK_K,
                EVEN_K,
                DOT_FP32,
                W_EVICT,
                BALANCED,
            )
            up_acc = _tile_dot(
                up_acc,
                x_rows,
                w_rows + N * stride_w_row,
                w_mask,
                k_begin,
                k_end,
                K,
                BLOCK_K,
                EVEN_K,
                DOT_FP32,
                W_EVICT,
                BALANCED,
            )
    else:
        if PREFETCH_TILES >= 1:
            acc = _prefetched_dot(acc, w_0, x_rows, k_begin, 0, k_end, BLOCK_K, DOT_FP32)
        if PREFETCH_TILES >= 2:
            acc = _prefetched_dot(acc, w_1, x_rows, k_begin, 1, k_end, BLOCK_K, DOT_FP32)
        loop_begin = tl.minimum(k_begin + PREFETCH_TILES * BLOCK_K, k_end)
        acc = _tile_dot(
            acc,
            x_rows,
            w_rows,
            w_mask,
            loop_begin,
            k_end,
            K,
            BLOCK_K,
            EVEN_K,
            DOT_FP32,
            W_EVICT,
            BALANCED,
        )

    last = True
    if SPLIT:
        # Scratch [num_splits, num_tiles, parts, BLOCK_N, BLOCK_M] float32, one tile contiguous.
        parts = 2 if SILU_MUL else 1
        tile_size = BLOCK_N * BLOCK_M
        split_stride = tl.num_programs(0) * parts * tile_size
        in_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_offsets = tile * parts * tile_size + in_tile
        tl.store(partial_ptr + split * split_stride + tile_offsets, acc)
        if SILU_MUL:
            tl.store(partial_ptr + split * split_stride + tile_offsets + tile_size, up_acc)
        counter = counters_ptr + tile
        last = attention_merge.arrive_last(counter, num_splits)
        if last:
            acc = _sum_splits_in_order(
                acc, partial_ptr, tile_offsets, split, num_splits, split_stride
            )
            if SILU_MUL:
                up_acc = _sum_splits_in_order(
                    up_acc, partial_ptr, tile_offsets + tile_size, split, num_splits, split_stride
                )
            tl.store(counter, 0)  # ready for the next launch (or graph replay)
    if last:
        out_type = out_ptr.dtype.element_ty
        if NORMED:
            inv_rms = pending_norm.inverse_rms(square_sums, K, eps)
            acc *= inv_rms[None, :]
            if SILU_MUL:
                up_acc *= inv_rms[None, :]
        if SILU_MUL:
            gate = acc.to(out_type).to(tl.float32)
            up = up_acc.to(out_type).to(tl.float32)
            y = gate / (1.0 + tl.exp(-gate)) * up
        else:
            y = acc
            if HAS_BIAS:
                y += tl.load(bias_ptr + safe_features).to(tl.float32)[:, None]
        offsets = rows.to(tl.int64)[None, :] * stride_out_row + features[:, None]
        mask = feature_mask[:, None] & row_mask[None, :]
        if ADD_NORM:
            norm_w = tl.load(norm_w_ptr + safe_features).to(tl.float32)[:, None]
            squares = pending_norm.add_residual_and_square(
                y,
                residual_ptr + offsets,
                out_ptr + offsets,
                norm_w,
                weighted_ptr + offsets,
                mask,
                0,
            )
            sums_offsets = rows.to(tl.int64) * tl.num_programs(0) + tile
            tl.store(out_sums_ptr + sums_offsets, squares, mask=row_mask)
        else:
            tl.store(out_ptr + offsets, y.to(out_type), mask=mask)
