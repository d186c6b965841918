"""Grammar masks on the logits: each masked row may draw only the tokens its bitmask allows.

A mask row is little-endian int32 words, bit ``j`` of word ``i`` allowing token ``32 i + j``
(xgrammar's layout, scheduler_proc/grammar.py). A row may carry a gate: the mask holds only
if the row's previous token is the gate token (a grammar that starts after ``</think>``,
worker_proc/logit_edits.py), decided on the device.

Grid ``(masked rows, vocab blocks)``: each program reads one block's words and writes -inf
to the disallowed columns, nothing else; a row whose gate is shut reads nothing and writes
nothing. The torch reference (the CPU path) looks each mask byte up in a table of eight
bounds, +inf where a bit is set and -inf where it is clear, and takes the minimum of each
logit and its bound: a few passes over ``[rows, vocab]``, which the kernel's single masked
store replaces.
"""

from __future__ import annotations

import torch

from kernels.backend import cdiv, load_triton, triton_jit, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()

BLOCK = 4096
# Per (dtype, device): row b holds the bounds of the 8 tokens of a mask byte of value b.
_BYTE_BOUNDS: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _byte_bounds(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    bounds = _BYTE_BOUNDS.get((dtype, device))
    if bounds is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        bounds = torch.where(bits.bool(), float("inf"), float("-inf")).to(
            dtype=dtype, device=device
        )
        _BYTE_BOUNDS[(dtype, device)] = bounds
    return bounds


def apply_token_bitmask_ref(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    bitmask: torch.Tensor,
    gate_tokens: torch.Tensor | None = None,
    previous_tokens: torch.Tensor | None = None,
) -> None:
    """Set to -inf, in place, the logits of row ``batch_rows[i]`` whose bit in
    ``bitmask[i]`` is clear, unless ``gate_tokens[i]`` is a token (not -1) other than
    ``previous_tokens[i]``."""
    vocab = logits.shape[1]
    if gate_tokens is not None:
        assert previous_tokens is not None
        # The rows whose gate is open (a boolean index: free on the CPU, where this runs).
        holds = (gate_tokens < 0) | (previous_tokens == gate_tokens)
        batch_rows, bitmask = batch_rows[holds], bitmask[holds]
    num_rows, num_words = bitmask.shape
    if num_rows == 0:
        return
    # Little-endian words: byte k of word i holds the bits of tokens 32 i + 8 k ... + 7.
    mask_bytes = bitmask.contiguous().view(torch.uint8).long()
    bounds = torch.nn.functional.embedding(mask_bytes, _byte_bounds(logits.dtype, logits.device))
    bounds = bounds.view(num_rows, num_words * 32)[:, :vocab]
    for index, row in enumerate(batch_rows.tolist()):
        torch.minimum(logits[row], bounds[index], out=logits[row])


@triton_jit
def _token_bitmask_kernel(
    logits_ptr,
    rows_ptr,
    bitmask_ptr,
    gates_ptr,
    previous_ptr,
    vocab,
    stride_row,
    stride_mask,
    HAS_GATES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    limit = vocab
    if HAS_GATES:
        gate = tl.load(gates_ptr + index)
        # A shut gate: no column is active, nothing is read or written.
        limit = tl.where((gate < 0) | (tl.load(previous_ptr + index) == gate), vocab, 0)
    active = columns < limit
    words = tl.load(bitmask_ptr + index * stride_mask + columns // 32, mask=active, other=-1)
    allowed = ((words >> (columns % 32)) & 1) != 0
    row = tl.load(rows_ptr + index)
    tl.store(logits_ptr + row * stride_row + columns, float("-inf"), mask=active & ~allowed)


def apply_token_bitmask_triton(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    bitmask: torch.Tensor,
    gate_tokens: torch.Tensor | None = None,
    previous_tokens: torch.Tensor | None = None,
    block: int = BLOCK,
) -> None:
    num_masked, vocab = batch_rows.shape[0], logits.shape[1]
    if num_masked == 0:
        return
    load_triton()
    has_gates = gate_tokens is not None
    _token_bitmask_kernel[(num_masked, cdiv(vocab, block))](
        logits,
        batch_rows,
        bitmask,
        gate_tokens if has_gates else batch_rows,
        previous_tokens if has_gates else batch_rows,
        vocab,
        logits.stride(0),
        bitmask.stride(0),
        HAS_GATES=has_gates,
        BLOCK=block,
        num_warps=4,
    )


def apply_token_bitmask(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    bitmask: torch.Tensor,
    gate_tokens: torch.Tensor | None = None,
    previous_tokens: torch.Tensor | None = None,
) -> None:
    """``logits [N, vocab]`` (row-contiguous), ``batch_rows [r]`` int64 (distinct),
    ``bitmask [r, words]`` int32 with ``32 * words >= vocab``; ``gate_tokens`` and
    ``previous_tokens [r]`` int64, both or neither."""
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("apply_token_bitmask takes row-contiguous [rows, vocab] logits")
    if bitmask.shape[0] != batch_rows.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"a bitmask of {tuple(bitmask.shape)} for {batch_rows.shape[0]} rows of "
            f"{logits.shape[1]} tokens"
        )
    if (gate_tokens is None) != (previous_tokens is None):
        raise ValueError("gate_tokens and previous_tokens come together")
    if use_triton(logits):
        apply_token_bitmask_triton(
            logits, batch_rows, bitmask.contiguous(), gate_tokens, previous_tokens
        )
    else:
        apply_token_bitmask_ref(logits, batch_rows, bitmask, gate_tokens, previous_tokens)
