"""One draw from each row's softmax, in one pass over the row: the Gumbel-max race.

``argmax_i(s_i + G_i)``, with ``s = values * inv_temperature`` and ``G_i = -log(E_i)`` for
``E_i ~ Exp(1)``, is a draw from ``softmax(s)``: the exponential race ``argmax(p_i / E_i)``
in log space, where the softmax's normalisation drops out. So a row needs no softmax, no
noise tensor and no division: each program reads its chunk of the row once, makes each
entry's noise from a counter-based hash of (row key, position, column), and keeps the best
entry; the last of a row's programs to arrive reduces the chunks' pairs in chunk order
(kernels/argmax.py does the same for the plain argmax). Entries at -inf (cut by a filter)
never win.

The noise is ``worker_proc.sampling_noise``'s: the same 32-bit hash, here in uint32
arithmetic (the reference's int64 products masked to 32 bits are these wrapping ones), so a
row's draw depends only on its key, its position and its values. A key of -1 (an unseeded
row) becomes one of ``call_key`` and the row's index, as ``effective_keys`` makes it.

The reference is ``race_rows_ref``, in torch over the whole row.
"""

from __future__ import annotations

import torch

from kernels import argmax
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

CHUNK = 4096


def race_rows_ref(
    values: torch.Tensor,
    inv_temperature: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    """``[rows, vocab]`` values (any float dtype), ``[rows]`` float32 inverse temperatures,
    int64 keys (32-bit, or -1) and int64 positions -> ``[rows]`` int64 drawn columns."""
    from worker_proc.sampling_noise import effective_keys, seeded_exponentials, vocab_salt

    scores = values.float() * inv_temperature.unsqueeze(1)
    salt = vocab_salt(values.shape[1], values.device)
    noise = seeded_exponentials(effective_keys(keys, call_key), positions, salt)
    # NaN counts as +inf, as in the argmax kernel.
    scores = torch.nan_to_num(scores, nan=float("inf"), posinf=float("inf"))
    return (scores - noise.log()).argmax(dim=-1)


# The hash's constants are worker_proc.sampling_noise's, written out: a Triton kernel reads
# no module-level integer.
@triton_jit
def mix32_u32(x):
    """``sampling_noise.mix32`` on uint32 values (its products wrap, as masked there)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    return x ^ (x >> 16)


@triton_jit
def log_noise(keys_ptr, positions_ptr, row, call_key, ids):
    """``log(E)`` of row ``row``'s noise at vocabulary ids ``ids``: ``E = -log(uniform)``,
    the uniform from the hash of (the row's key, its position, the id), as
    ``sampling_noise.seeded_exponentials`` makes it. Subtracted from a score, it makes the
    Gumbel-max form of the exponential race. A key of -1 takes one of ``call_key`` and
    ``row``."""
    seed_key = tl.load(keys_ptr + row)
    own_key = (seed_key & 0xFFFFFFFF).to(tl.uint32)
    call_row_key = mix32_u32(((row ^ call_key) & 0xFFFFFFFF).to(tl.uint32))
    key = tl.where(seed_key >= 0, own_key, call_row_key)
    position = (tl.load(positions_ptr + row) & 0xFFFFFFFF).to(tl.uint32)
    row_hash = mix32_u32(key ^ mix32_u32(position))
    salt = mix32_u32(ids.to(tl.uint32) ^ 0x5BD1E995)  # ids: int32 columns or int64 ids
    bits = mix32_u32(row_hash ^ salt)
    # 23 bits, so that the uniform stays below 1.0 in float32 (sampling_noise.py says why).
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / (1 << 23))
    return tl.log(-tl.log(uniform))


# call_key changes at every call: specialized, its value would pick a variant.
@triton_jit(do_not_specialize=("call_key",))
def _race_kernel(
    values_ptr,
    inv_temperature_ptr,
    keys_ptr,
    positions_ptr,
    out_ptr,
    partial_score_ptr,
    partial_index_ptr,
    counters_ptr,
    call_key,
    vocab,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)
    values = tl.load(
        values_ptr + row * stride_row + columns, mask=columns < vocab, other=float("-inf")
    ).to(tl.float32)
    scores = values * tl.load(inv_temperature_ptr + row)
    scores = tl.where(scores != scores, float("inf"), scores)
    scores = scores - log_noise(keys_ptr, positions_ptr, row, call_key, columns)
    # Columns past the row load -inf, and stay -inf: no noise lifts them.
    argmax.argmax_across_chunks(
        scores, columns, row, chunk, num_chunks, vocab, out_ptr, partial_score_ptr,
        partial_index_ptr, counters_ptr, CHUNKS_PAD,
    )  # fmt: skip


def race_rows_triton(
    values: torch.Tensor,
    inv_temperature: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
    chunk: int = CHUNK,
) -> torch.Tensor:
    if not 0 <= call_key < 2**31:  # an int32 argument always: one compiled variant
        raise ValueError(f"call_key must be in [0, 2**31), got {call_key}")
    rows, vocab = values.shape
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows == 0:
        return out
    if values.stride(-1) != 1:
        values = values.contiguous()
    load_triton()
    num_chunks = cdiv(vocab, chunk)
    partial_score = torch.empty(rows * num_chunks, dtype=torch.float32, device=values.device)
    partial_index = torch.empty(rows * num_chunks, dtype=torch.int32, device=values.device)
    _race_kernel[(rows, num_chunks)](
        values,
        inv_temperature.float().contiguous(),
        keys.contiguous(),
        positions.contiguous(),
        out,
        partial_score,
        partial_index,
        split_counters(rows, values.device),
        call_key,
        vocab,
        values.stride(0),
        num_chunks,
        CHUNK=chunk,
        CHUNKS_PAD=next_power_of_2(num_chunks),
        num_warps=4,
    )
    return out


def race_rows(
    values: torch.Tensor,
    inv_temperature: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    """Each row's column drawn from ``softmax(values * inv_temperature)`` with the noise of
    (key, position, column): ``[rows, vocab]``, ``[rows]`` x 3 -> ``[rows]`` int64. A key of
    -1 takes one made of ``call_key`` (in [0, 2**31)) and the row's index."""
    if values.dim() != 2:
        raise ValueError(f"race_rows takes [rows, vocab] values, got {tuple(values.shape)}")
    rows = values.shape[0]
    for name, tensor in (
        ("inv_temperature", inv_temperature),
        ("keys", keys),
        ("positions", positions),
    ):
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must be [{rows}], got {tuple(tensor.shape)}")
    if use_triton(values):
        return race_rows_triton(values, inv_temperature, keys, positions, call_key)
    return race_rows_ref(values, inv_temperature, keys, positions, call_key)
