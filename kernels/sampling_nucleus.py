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

A row is split into chunks, one program each, as the race splits it: the first pass and
``ROUNDS`` rounds are launches over every chunk, each row's last program to arrive reducing
the chunks in chunk order (so the sums do not depend on which program ends last) and
filing the row's state: its largest score and softmax sum, the draw, its score, and whether
it stands. A round finds a row that stands and does nothing. The rare row still searching
after them ends in one program of its own, which goes on round by round over its row.

The reference is ``race_nucleus_ref``, the same search in torch.
"""

from __future__ import annotations

import torch

from kernels import attention_merge, sampling_race
from kernels.attention_merge import split_counters
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

CHUNK = 4096
# Rounds over every chunk before a row still searching goes on in one program: most rows
# stand after one or two.
ROUNDS = 3
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
def _best(keyed, scores, columns):
    """The best keyed entry (ties to the lowest column, as torch's argmax), its column and
    its score."""
    best = tl.max(keyed, axis=0)
    choice = tl.min(tl.where(keyed == best, columns, 2147483647), axis=0)
    score = tl.max(tl.where(columns == choice, scores, float("-inf")), axis=0)
    return best, choice, score


@triton_jit
def _round_chunk(row_values, columns, vocab, inv_temperature, keys_ptr, positions_ptr, row,
                 call_key, top, bound, floor):  # fmt: skip
    """One chunk of a round: the mass above the bound (scaled by the row's largest score),
    and the race over the scores above the bound and over the min-p floor."""
    scores = _row_scores(row_values, columns, vocab, inv_temperature)
    above = scores > bound
    mass = tl.sum(tl.where(above, tl.exp(scores - top), 0.0), axis=0)
    noise = sampling_race.log_noise(keys_ptr, positions_ptr, row, call_key, columns)
    keyed = tl.where(above & (scores >= floor), scores - noise, float("-inf"))
    best, choice, score = _best(keyed, scores, columns)
    return mass, best, choice, score


@triton_jit
def _chunk_partials(partial_ptr, choice_ptr, first, num_chunks, CHUNKS_PAD: tl.constexpr):
    """A row's chunks' four float partials and their draws, in chunk order (``.cg``: the
    other programs' stores, never a stale L1)."""
    chunks = tl.arange(0, CHUNKS_PAD)
    in_row = chunks < num_chunks
    slots = (first + chunks) * 4
    a = tl.load(partial_ptr + slots, mask=in_row, other=float("-inf"), cache_modifier=".cg")
    b = tl.load(partial_ptr + slots + 1, mask=in_row, other=0.0, cache_modifier=".cg")
    best = tl.load(partial_ptr + slots + 2, mask=in_row, other=float("-inf"), cache_modifier=".cg")
    score = tl.load(partial_ptr + slots + 3, mask=in_row, other=float("-inf"), cache_modifier=".cg")
    choice = tl.load(
        choice_ptr + first + chunks, mask=in_row, other=2147483647, cache_modifier=".cg"
    )
    return a, b, best, score, choice


@triton_jit
def _reduce_best(bests, scores, choices):
    best = tl.max(bests, axis=0)
    choice = tl.min(tl.where(bests == best, choices, 2147483647), axis=0)
    score = tl.max(tl.where(choices == choice, scores, float("-inf")), axis=0)
    return choice, score


@triton_jit
def _row_state(state_ptr, state_choice_ptr, top_p_ptr, min_p_ptr, row):
    top = tl.load(state_ptr + row * 4)
    total = tl.load(state_ptr + row * 4 + 1)
    bound = tl.load(state_ptr + row * 4 + 2)
    choice = tl.load(state_choice_ptr + row * 2)
    top_p = tl.load(top_p_ptr + row)
    floor = top + tl.log(tl.load(min_p_ptr + row))
    return top, top_p * total, top_p, bound, floor, choice


# call_key changes at every call: specialized, its value would pick a variant.
@triton_jit(do_not_specialize=("call_key",))
def _pass_kernel(
    values_ptr,
    inv_temperature_ptr,
    top_p_ptr,
    min_p_ptr,
    keys_ptr,
    positions_ptr,
    partial_ptr,
    partial_choice_ptr,
    counters_ptr,
    state_ptr,
    state_choice_ptr,
    call_key,
    vocab,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    FIRST: tl.constexpr,
):
    """One pass over every chunk of a row. FIRST: the row's largest score, its softmax sum
    and the race over it all. Otherwise a round, in the rows still searching."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    columns = chunk * CHUNK + tl.arange(0, CHUNK)
    row_values = values_ptr + row * stride_row
    slot = row * num_chunks + chunk
    if FIRST:
        scores = _row_scores(row_values, columns, vocab, tl.load(inv_temperature_ptr + row))
        top = tl.max(scores, axis=0)
        total = tl.sum(tl.exp(scores - tl.where(top == float("-inf"), 0.0, top)), axis=0)
        noise = sampling_race.log_noise(keys_ptr, positions_ptr, row, call_key, columns)
        best, choice, score = _best(scores - noise, scores, columns)
        tl.store(partial_ptr + slot * 4, top)
        tl.store(partial_ptr + slot * 4 + 1, total)
        tl.store(partial_ptr + slot * 4 + 2, best)
        tl.store(partial_ptr + slot * 4 + 3, score)
        tl.store(partial_choice_ptr + slot, choice)
        if attention_merge.arrive_last(counters_ptr + row, num_chunks):
            tops, totals, bests, chunk_scores, choices = _chunk_partials(
                partial_ptr, partial_choice_ptr, row * num_chunks, num_chunks, CHUNKS_PAD
            )
            top = tl.max(tops, axis=0)
            shift = tl.where(top == float("-inf"), 0.0, top)
            total = tl.sum(totals * tl.exp(tops - shift), axis=0)
            choice, score = _reduce_best(bests, chunk_scores, choices)
            tl.store(state_ptr + row * 4, top)
            tl.store(state_ptr + row * 4 + 1, total)
            tl.store(state_ptr + row * 4 + 2, score)
            tl.store(state_choice_ptr + row * 2, choice)
            # A row of -inf (every token cut before) or holding +inf stands with the race's
            # draw, and so does a draw without top-p over its min-p floor.
            done = (top == float("inf")) | (top == float("-inf"))
            floor = top + tl.log(tl.load(min_p_ptr + row))
            done |= (tl.load(top_p_ptr + row) >= 1.0) & (score >= floor)
            tl.store(state_choice_ptr + row * 2 + 1, done.to(tl.int32))
            tl.store(counters_ptr + row, 0)  # ready for the next launch
    elif tl.load(state_choice_ptr + row * 2 + 1) == 0:
        top, limit, top_p, bound, floor, choice = _row_state(
            state_ptr, state_choice_ptr, top_p_ptr, min_p_ptr, row
        )
        mass, best, next_choice, next_bound = _round_chunk(
            row_values, columns, vocab, tl.load(inv_temperature_ptr + row), keys_ptr,
            positions_ptr, row, call_key, top, bound, floor,
        )  # fmt: skip
        tl.store(partial_ptr + slot * 4, mass)
        tl.store(partial_ptr + slot * 4 + 2, best)
        tl.store(partial_ptr + slot * 4 + 3, next_bound)
        tl.store(partial_choice_ptr + slot, next_choice)
        if attention_merge.arrive_last(counters_ptr + row, num_chunks):
            masses, _, bests, bounds, choices = _chunk_partials(
                partial_ptr, partial_choice_ptr, row * num_chunks, num_chunks, CHUNKS_PAD
            )
            mass = tl.sum(tl.where(masses == float("-inf"), 0.0, masses), axis=0)
            stands = (mass <= limit) & (bound >= floor)
            next_choice, next_bound = _reduce_best(bests, bounds, choices)
            tl.store(state_ptr + row * 4 + 2, tl.where(stands, bound, next_bound))
            tl.store(state_choice_ptr + row * 2, tl.where(stands, choice, next_choice))
            # Without top-p the next draw, over the min-p floor, stands.
            done = stands | (top_p >= 1.0)
            tl.store(state_choice_ptr + row * 2 + 1, done.to(tl.int32))
            tl.store(counters_ptr + row, 0)


@triton_jit(do_not_specialize=("call_key",))
def _finish_kernel(
    values_ptr,
    inv_temperature_ptr,
    top_p_ptr,
    min_p_ptr,
    keys_ptr,
    positions_ptr,
    state_ptr,
    state_choice_ptr,
    out_ptr,
    call_key,
    vocab,
    stride_row,
    CHUNK: tl.constexpr,
):
    """Each row's draw; a row still searching goes on alone, round by round."""
    row = tl.program_id(0).to(tl.int64)
    row_values = values_ptr + row * stride_row
    inv_temperature = tl.load(inv_temperature_ptr + row)
    top, limit, top_p, bound, floor, choice = _row_state(
        state_ptr, state_choice_ptr, top_p_ptr, min_p_ptr, row
    )
    done = tl.load(state_choice_ptr + row * 2 + 1)
    offsets = tl.arange(0, CHUNK)
    while done == 0:
        mass = tl.zeros((), tl.float32)
        next_best = tl.full((), float("-inf"), tl.float32)
        next_choice = choice
        next_bound = bound
        for start in range(0, vocab, CHUNK):
            chunk_mass, best, chunk_choice, chunk_bound = _round_chunk(
                row_values, start + offsets, vocab, inv_temperature, keys_ptr, positions_ptr,
                row, call_key, top, bound, floor,
            )  # fmt: skip
            mass += chunk_mass
            better = best > next_best
            next_best = tl.where(better, best, next_best)
            next_choice = tl.where(better, chunk_choice, next_choice)
            next_bound = tl.where(better, chunk_bound, next_bound)
        stands = (mass <= limit) & (bound >= floor)
        choice = tl.where(stands, choice, next_choice)
        bound = tl.where(stands, bound, next_bound)
        done = (stands | (top_p >= 1.0)).to(tl.int32)
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
    rounds: int = ROUNDS,
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
    device = values.device
    partial = torch.empty(rows * num_chunks * 4, dtype=torch.float32, device=device)
    partial_choice = torch.empty(rows * num_chunks, dtype=torch.int32, device=device)
    state = torch.empty(rows * 4, dtype=torch.float32, device=device)
    state_choice = torch.empty(rows * 2, dtype=torch.int32, device=device)
    counters = split_counters(rows, device)
    inv_temperature = inv_temperature.float().contiguous()
    top_p = top_p.float().contiguous()
    min_p = min_p.float().contiguous()
    keys = keys.contiguous()
    positions = positions.contiguous()
    args = (values, inv_temperature, top_p, min_p, keys, positions, partial, partial_choice,
            counters, state, state_choice, call_key, vocab, values.stride(0), num_chunks)  # fmt: skip
    shape = dict(CHUNK=chunk, CHUNKS_PAD=next_power_of_2(num_chunks), num_warps=4)
    _pass_kernel[(rows, num_chunks)](*args, **shape, FIRST=True)
    for _ in range(rounds):
        _pass_kernel[(rows, num_chunks)](*args, **shape, FIRST=False)
    _finish_kernel[(rows,)](
        values, inv_temperature, top_p, min_p, keys, positions, state, state_choice, out,
        call_key, vocab, values.stride(0), CHUNK=chunk, num_warps=8,
    )  # fmt: skip
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
