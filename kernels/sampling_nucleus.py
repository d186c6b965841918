"""One draw from each row's top-p (nucleus) and min-p cut, over the whole row, without a sort.

Sorted, a row keeps the tokens whose probability mass strictly before them is at most top-p,
and those whose probability is at least min-p times the largest. Both cuts keep the row's
scores from some bound up, so a kept set ``T`` is ``{s >= t}`` for a bound ``t`` unknown in
advance. The race (kernels/sampling_race.py) draws ``argmax_i(s_i + G_i)``; with the same
noise, the draw over any set that holds ``T`` and whose winner lies in ``T`` is the draw over
``T``: the winner of the larger set beats every entry of ``T``. So a pivot search finds it:

1. one pass: the row's largest score, its softmax sum, and the race over the whole row;
2. while the winner ``d`` is cut (the mass of scores above ``s_d`` passes top-p times the
   sum, or ``s_d`` is under the min-p bound), every score at or under ``s_d`` is cut as well;
   the next pass races the scores above ``s_d`` (and over the min-p bound), and in the same
   pass sums the mass above ``s_d``, which decides whether ``d`` stood.

Each round only raises the bound, and the largest score always stands, so the search ends;
on random rows of Qwen3's vocabulary at top-p 0.5-0.95 it took 1.1-1.8 draws on average, so
two or three passes over the row against a sort of it. Ties to a score at the bound are
kept or cut together (a sort keeps some of them, in its own order). The noise is the race's,
so a seeded row draws what the race over its filtered row would.

One program a row. The reference is ``race_nucleus_ref``, the same search in torch.
"""

from __future__ import annotations

import torch

from kernels import sampling_race
from kernels.backend import load_triton, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

CHUNK = 4096
NUM_WARPS = 8
# A row's top-p at this value is off: mass rounded past the sum must not cut a token.
TOP_P_OFF = 2.0


def race_nucleus_ref(
    values: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    """``[rows, vocab]`` values (any float dtype); per row float32 ``inv_temperature``,
    ``top_p`` (``TOP_P_OFF`` or more: off) and ``min_p`` (0: off), int64 ``keys`` (32-bit,
    or -1) and ``positions`` -> ``[rows]`` int64 drawn columns."""
    from worker_proc.sampling_noise import effective_keys, seeded_exponentials, vocab_salt

    scores = values.float() * inv_temperature.float().unsqueeze(1)
    scores = torch.nan_to_num(scores, nan=float("inf"), posinf=float("inf"))
    salt = vocab_salt(values.shape[1], values.device)
    noise = seeded_exponentials(effective_keys(keys, call_key), positions, salt)
    keyed = scores - noise.log()
    top = scores.amax(dim=1, keepdim=True)
    finite = torch.isfinite(top)
    weights = torch.exp(scores - torch.where(finite, top, 0.0))
    limit = top_p.float().unsqueeze(1) * weights.sum(dim=1, keepdim=True)
    floor = top + torch.log(min_p.float()).unsqueeze(1)
    # The min-p bound is known before any draw here (the kernel learns it in its first
    # pass), so the first race already leaves out what it cuts: the same winner, sooner.
    choice = keyed.masked_fill(scores < floor, float("-inf")).argmax(dim=1, keepdim=True)
    # A row of -inf (every token cut before) or holding +inf draws as the race does; without
    # top-p that first draw stands.
    done = ~finite | (top_p.float().unsqueeze(1) >= 1.0)
    while not bool(done.all()):
        bound = scores.gather(1, choice)
        above = scores > bound
        mass = torch.where(above, weights, 0.0).sum(dim=1, keepdim=True)
        stands = (mass <= limit) & (bound >= floor)
        candidates = keyed.masked_fill(~(above & (scores >= floor)), float("-inf"))
        choice = torch.where(done | stands, choice, candidates.argmax(dim=1, keepdim=True))
        done = done | stands
    return choice.squeeze(1)


@triton_jit
def _row_scores(row_values, columns, vocab, inv_temperature):
    values = tl.load(row_values + columns, mask=columns < vocab, other=float("-inf"))
    scores = values.to(tl.float32) * inv_temperature
    return tl.where(scores != scores, float("inf"), scores)


@triton_jit
def _chunk_best(keyed, scores, columns, best, choice, bound):
    """The running race: the chunk's best keyed entry replaces the one so far only when
    strictly better, so ties go to the lowest column, as torch's argmax takes them."""
    chunk_best = tl.max(keyed, axis=0)
    chunk_choice = tl.min(tl.where(keyed == chunk_best, columns, 2147483647), axis=0)
    chunk_score = tl.max(tl.where(columns == chunk_choice, scores, float("-inf")), axis=0)
    better = chunk_best > best
    return (
        tl.where(better, chunk_best, best),
        tl.where(better, chunk_choice, choice),
        tl.where(better, chunk_score, bound),
    )


# call_key changes at every call: specialized, its value would pick a variant.
@triton_jit(do_not_specialize=("call_key",))
def _nucleus_kernel(
    values_ptr,
    inv_temperature_ptr,
    top_p_ptr,
    min_p_ptr,
    keys_ptr,
    positions_ptr,
    out_ptr,
    call_key,
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_values = values_ptr + row * stride_row
    inv_temperature = tl.load(inv_temperature_ptr + row)
    offsets = tl.arange(0, CHUNK)
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    choice = tl.zeros((), tl.int32)
    bound = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, CHUNK):
        columns = start + offsets
        scores = _row_scores(row_values, columns, vocab, inv_temperature)
        new_top = tl.maximum(top, tl.max(scores, axis=0))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - shift) + tl.sum(tl.exp(scores - shift), axis=0)
        top = new_top
        keyed = scores - sampling_race.log_noise(keys_ptr, positions_ptr, row, call_key, columns)
        best, choice, bound = _chunk_best(keyed, scores, columns, best, choice, bound)
    limit = tl.load(top_p_ptr + row) * total
    floor = top + tl.log(tl.load(min_p_ptr + row))
    # A row of -inf (every token cut before) or holding +inf stands with the race's draw.
    done = ((top == float("inf")) | (top == float("-inf"))).to(tl.int32)
    while done == 0:
        mass = tl.zeros((), tl.float32)
        next_best = tl.full((), float("-inf"), tl.float32)
        next_choice = choice
        next_bound = bound
        for start in range(0, vocab, CHUNK):
            columns = start + offsets
            scores = _row_scores(row_values, columns, vocab, inv_temperature)
            above = scores > bound
            mass += tl.sum(tl.where(above, tl.exp(scores - top), 0.0), axis=0)
            noise = sampling_race.log_noise(keys_ptr, positions_ptr, row, call_key, columns)
            keyed = tl.where(above & (scores >= floor), scores - noise, float("-inf"))
            next_best, next_choice, next_bound = _chunk_best(
                keyed, scores, columns, next_best, next_choice, next_bound
            )
        stands = (mass <= limit) & (bound >= floor)
        choice = tl.where(stands, choice, next_choice)
        bound = tl.where(stands, bound, next_bound)
        done = stands.to(tl.int32)
    tl.store(out_ptr + row, choice.to(tl.int64))


def race_nucleus_triton(
    values: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
    chunk: int = CHUNK,
    num_warps: int = NUM_WARPS,
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
    _nucleus_kernel[(rows,)](
        values,
        inv_temperature.float().contiguous(),
        top_p.float().contiguous(),
        min_p.float().contiguous(),
        keys.contiguous(),
        positions.contiguous(),
        out,
        call_key,
        vocab,
        values.stride(0),
        CHUNK=chunk,
        num_warps=num_warps,
    )
    return out


def race_nucleus(
    values: torch.Tensor,
    inv_temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    """Each row's column drawn from ``softmax(values * inv_temperature)`` after its top-p and
    min-p cuts, with the race's noise (see ``race_nucleus_ref`` for the arguments)."""
    if values.dim() != 2:
        raise ValueError(f"race_nucleus takes [rows, vocab] values, got {tuple(values.shape)}")
    rows = values.shape[0]
    for name, tensor in (
        ("inv_temperature", inv_temperature),
        ("top_p", top_p),
        ("min_p", min_p),
        ("keys", keys),
        ("positions", positions),
    ):
        if tensor.shape != (rows,):
            raise ValueError(f"{name} must be [{rows}], got {tuple(tensor.shape)}")
    if use_triton(values):
        return race_nucleus_triton(values, inv_temperature, top_p, min_p, keys, positions, call_key)
    return race_nucleus_ref(values, inv_temperature, top_p, min_p, keys, positions, call_key)
