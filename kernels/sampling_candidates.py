"""One draw from each row's top-k candidates after its top-k, top-p and min-p cuts, in one
launch.

A row with a small top-k (Qwen3's recommended 20) is drawn from its largest scores alone:
the sampler finds each row's ``width`` largest scaled scores with one ``topk`` (sorted,
descending) and hands them here with their vocabulary ids. One program a row then cuts the
ranks past the row's top-k, the tokens whose probability mass before them passes top-p, and
those below min-p times the largest probability (in that order, each on what the one before
left, softmax over what is left), and races the rest as kernels/sampling_race.py does: each
candidate's noise is the hash of (row key, position, vocabulary id), the noise that id gets
in the whole row, so the draw is the whole row's.

The reference is ``race_candidates_ref``, the same steps in torch.
"""

from __future__ import annotations

import torch

from kernels import sampling_race
from kernels.backend import load_triton, next_power_of_2, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()


def race_candidates_ref(
    values: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    """``values [rows, width]`` float32 scaled scores sorted descending, ``ids`` their int64
    vocabulary ids; per row ``top_k`` (int64, 1..width), ``top_p`` and ``min_p`` (float32, or
    None where no row cuts by it), int64 ``keys`` (32-bit, or -1) and ``positions`` ->
    ``[rows]`` int64 drawn vocabulary ids."""
    from worker_proc.sampling_noise import VOCAB_SALT, effective_keys, mix32, seeded_exponentials

    ranks = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
    values = values.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = values.softmax(dim=-1)
        # Mass strictly before each token; the most likely token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        values = values.masked_fill(mass_before > top_p.unsqueeze(1), float("-inf"))
    if min_p is not None:
        probs = values.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        values = values.masked_fill(probs < threshold, float("-inf"))
    salt = mix32(ids ^ VOCAB_SALT)
    noise = seeded_exponentials(effective_keys(keys, call_key), positions, salt)
    choice = (values - noise.log()).argmax(dim=-1, keepdim=True)
    return ids.gather(1, choice).squeeze(1)


@triton_jit
def _softmax(values):
    top = tl.max(values, axis=0)
    exps = tl.exp(values - top)
    return exps / tl.sum(exps, axis=0)


# call_key changes at every call: specialized, its value would pick a variant.
@triton_jit(do_not_specialize=("call_key",))
def _candidates_kernel(
    values_ptr,
    ids_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    keys_ptr,
    positions_ptr,
    out_ptr,
    call_key,
    width,
    WIDTH_PAD: tl.constexpr,
    TOP_P: tl.constexpr,
    MIN_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ranks = tl.arange(0, WIDTH_PAD)
    in_row = ranks < width
    values = tl.load(values_ptr + row * width + ranks, mask=in_row, other=float("-inf"))
    ids = tl.load(ids_ptr + row * width + ranks, mask=in_row, other=0)
    values = tl.where(ranks < tl.load(top_k_ptr + row), values, float("-inf"))
    if TOP_P:
        probs = _softmax(values)
        mass_before = tl.cumsum(probs, axis=0) - probs
        values = tl.where(mass_before > tl.load(top_p_ptr + row), float("-inf"), values)
    if MIN_P:
        probs = _softmax(values)
        threshold = tl.load(min_p_ptr + row) * tl.max(probs, axis=0)
        values = tl.where(probs < threshold, float("-inf"), values)
    scores = values - sampling_race.log_noise(keys_ptr, positions_ptr, row, call_key, ids)
    best = tl.max(scores, axis=0)
    choice = tl.min(tl.where(scores == best, ranks, WIDTH_PAD), axis=0)
    tl.store(out_ptr + row, tl.sum(tl.where(ranks == choice, ids, 0), axis=0))


def race_candidates_triton(
    values: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    if not 0 <= call_key < 2**31:  # an int32 argument always: one compiled variant
        raise ValueError(f"call_key must be in [0, 2**31), got {call_key}")
    rows, width = values.shape
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows == 0:
        return out
    load_triton()
    _candidates_kernel[(rows,)](
        values.float().contiguous(),
        ids.contiguous(),
        top_k.contiguous(),
        top_k if top_p is None else top_p.float().contiguous(),  # unread when off
        top_k if min_p is None else min_p.float().contiguous(),
        keys.contiguous(),
        positions.contiguous(),
        out,
        call_key,
        width,
        WIDTH_PAD=next_power_of_2(width),
        TOP_P=top_p is not None,
        MIN_P=min_p is not None,
        num_warps=1,
    )
    return out


def race_candidates(
    values: torch.Tensor,
    ids: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    keys: torch.Tensor,
    positions: torch.Tensor,
    call_key: int = 0,
) -> torch.Tensor:
    """Each row's vocabulary id drawn from its candidates after its cuts (see
    ``race_candidates_ref`` for the arguments)."""
    if values.dim() != 2 or ids.shape != values.shape:
        raise ValueError(
            f"values and ids must be [rows, width] alike, got {tuple(values.shape)} and "
            f"{tuple(ids.shape)}"
        )
    if use_triton(values):
        return race_candidates_triton(values, ids, top_k, top_p, min_p, keys, positions, call_key)
    return race_candidates_ref(values, ids, top_k, top_p, min_p, keys, positions, call_key)
