"""Edits of some rows' logits before sampling: ``logit_bias``, ``bad_words``,
``allowed_token_ids``, ``min_tokens``, and the grammar of a request with structured output.

A request's ``logit_bias`` adds its values to its tokens' logits at every step. A request
whose output is still shorter than ``min_tokens`` cannot end it: its stop tokens (the
model's EOS, unless ``ignore_eos``, and its ``stop_token_ids``) are set to -inf, so the
sampler draws another token instead, as vLLM and HF ``generate`` (``min_new_tokens``) do.
Both act on the raw logits, before the penalties and the temperature; the logprobs a
request gets back are the model's own.

An edit is sparse: ``[rows, n]`` token ids and values, padded per row with a repeat of its
first id and a value that changes nothing (0 added, -inf set again). The bias is fixed for
a batch's composition; the stop-token mask changes when a row reaches its ``min_tokens``,
which the host knows at every step from the sequence's length.

A one-token bad word is a bias of -inf at every step. A longer one is banned at the steps the
scheduler names (scheduler_proc/bad_words.py), some gated on the row's token of the step
before, which only the device knows yet.

A request's ``allowed_token_ids`` keep those tokens' logits and set every other to -inf.

A grammar's edit is dense: the scheduler sends, per constrained row, a bitmask of the tokens
its grammar allows next (scheduler_proc/grammar.py); every other logit becomes -inf
(kernels/token_bitmask.py). A grammar that starts after a token (``</think>``) sends its
first mask once, with its sequence, and a step that may follow that token applies it only
if the row's token before is that one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

import kernels
from pegainfer.protocol import SamplingParams
from worker_proc.upload import Uploader


class HasSeqId(Protocol):
    seq_id: int


class SequenceLength(Protocol):
    """What the mask reads of a sequence (worker_proc/batch.py's SequenceState)."""

    sampling: SamplingParams
    num_tokens: int
    num_prompt_tokens: int


@dataclass
class TokenEdits:
    """Logits of ``token_ids`` in batch rows ``batch_rows``: ``values`` added (``add``), or
    written."""

    batch_rows: torch.Tensor  # [r] int64
    token_ids: torch.Tensor  # [r, n] int64
    values: torch.Tensor  # [r, n] float32
    add: bool

    def apply(self, logits: torch.Tensor) -> None:
        """Edit ``logits [N, vocab]`` (float32) in place."""
        rows = self.batch_rows.unsqueeze(1).expand_as(self.token_ids)
        # Padding repeats an id with 0 added, or -inf written again: each real edit counts once.
        logits.index_put_((rows, self.token_ids), self.values, accumulate=self.add)


def _padded(
    rows: Sequence[int],
    ids: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]] | None,
    pad_value: float,
) -> list[np.ndarray]:
    """Rows, ids and values as arrays (values None: every one ``pad_value``)."""
    width = max(len(row_ids) for row_ids in ids)
    id_array = np.empty((len(rows), width), dtype=np.int64)
    value_array = np.full((len(rows), width), pad_value, dtype=np.float32)
    for i, row_ids in enumerate(ids):
        id_array[i, : len(row_ids)] = row_ids
        id_array[i, len(row_ids) :] = row_ids[0]
        if values is not None:
            value_array[i, : len(row_ids)] = values[i]
    return [np.asarray(rows, dtype=np.int64), id_array, value_array]


def _banned_ids(params: SamplingParams) -> list[int]:
    return [word[0] for word in params.bad_words_token_ids if len(word) == 1]


def bias_edits(params: Sequence[SamplingParams], uploader: Uploader) -> TokenEdits | None:
    """The ``logit_bias`` of every row that has one, and its one-token bad words as a bias
    of -inf, or None."""
    banned = [_banned_ids(p) for p in params]
    rows = [i for i, p in enumerate(params) if p.logit_bias_ids or banned[i]]
    if not rows:
        return None
    ids = [params[i].logit_bias_ids + banned[i] for i in rows]
    values = [params[i].logit_bias_values + [float("-inf")] * len(banned[i]) for i in rows]
    arrays = _padded(rows, ids, values, 0.0)
    return TokenEdits(*uploader.upload(arrays, persistent=True), add=True)


@dataclass
class GatedBans:
    """Tokens banned this step (longer bad words): entry i bans ``token_ids[i]`` in batch row
    ``batch_rows[i]``, if ``gates[i]`` is -1 or the row's token of the step before."""

    batch_rows: torch.Tensor  # [e] int64
    token_ids: torch.Tensor  # [e] int64
    gates: torch.Tensor  # [e] int64
    values: torch.Tensor | None = None  # [e] float32: -inf where the ban holds, else 0

    def open_gates(self, last_tokens: torch.Tensor, sample_slot: torch.Tensor) -> None:
        """Decide each ban from the rows' tokens before (``last_tokens`` at each sampling
        row's slot ``sample_slot``), on the device: no sync."""
        previous = last_tokens.index_select(0, sample_slot.index_select(0, self.batch_rows))
        holds = (self.gates < 0) | (previous == self.gates)
        self.values = torch.zeros(holds.shape, dtype=torch.float32, device=holds.device)
        self.values.masked_fill_(holds, float("-inf"))

    def apply(self, logits: torch.Tensor) -> None:
        assert self.values is not None, "open_gates first"
        logits.index_put_((self.batch_rows, self.token_ids), self.values, accumulate=True)


def gated_bans(
    ban_seq_ids: Sequence[int],
    ban_token_ids: Sequence[int],
    ban_gates: Sequence[int],
    samplers: Sequence[HasSeqId],
    uploader: Uploader,
) -> GatedBans | None:
    """The step's bans (``StepPlan.ban_*``) for the sampling rows ``samplers``, or None."""
    if not ban_seq_ids:
        return None
    if not len(ban_seq_ids) == len(ban_token_ids) == len(ban_gates):
        raise ValueError("a step's bans need a token and a gate each")
    row_of = {seq.seq_id: i for i, seq in enumerate(samplers)}
    try:
        rows = [row_of[seq_id] for seq_id in ban_seq_ids]
    except KeyError as exc:
        raise ValueError(f"a ban for seq {exc.args[0]}, which samples no token") from None
    arrays = [np.asarray(values, dtype=np.int64) for values in (rows, ban_token_ids, ban_gates)]
    return GatedBans(*uploader.upload(arrays))


@dataclass
class KeepOnly:
    """Rows ``batch_rows`` may draw only their ``token_ids`` (padded by repeats)."""

    batch_rows: torch.Tensor  # [r] int64
    token_ids: torch.Tensor  # [r, n] int64

    def apply(self, logits: torch.Tensor) -> None:
        """Set the other tokens' logits of ``logits [N, vocab]`` (float32) to -inf, in place."""
        rows = logits.index_select(0, self.batch_rows)
        kept = rows.gather(1, self.token_ids)
        rows.fill_(float("-inf")).scatter_(1, self.token_ids, kept)
        logits.index_copy_(0, self.batch_rows, rows)


def keep_only_edits(params: Sequence[SamplingParams], uploader: Uploader) -> KeepOnly | None:
    """The ``allowed_token_ids`` of every row that has them, or None."""
    rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    arrays = _padded(rows, [params[i].allowed_token_ids for i in rows], None, 0.0)
    return KeepOnly(*uploader.upload(arrays[:2], persistent=True))


def stop_token_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would end the request: its stop token ids and, unless it ignores
    EOS, the model's."""
    ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        ids += [token for token in eos_token_ids if token not in ids]
    return ids


def needs_stop_mask(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether the token drawn after ``num_output_tokens`` output tokens must not stop the
    request: it would be output number ``num_output_tokens + 1``."""
    return num_output_tokens + 1 < params.min_tokens


def stop_mask_edits(
    rows: Sequence[int], stop_ids: Sequence[Sequence[int]], uploader: Uploader
) -> TokenEdits | None:
    """-inf at each row's stop tokens (rows with none left out), or None."""
    kept = [(row, ids) for row, ids in zip(rows, stop_ids, strict=True) if ids]
    if not kept:
        return None
    arrays = _padded([row for row, _ in kept], [ids for _, ids in kept], None, float("-inf"))
    return TokenEdits(*uploader.upload(arrays, persistent=True), add=False)


class StopMasks:
    """A batch's ``min_tokens`` masks, step by step. When the batch's composition changes the
    runner hands over its rows (``compose``); each step then looks only at the rows with a
    ``min_tokens``, and uploads a new mask only when the set still short of it changes."""

    def __init__(self, eos_token_ids: Sequence[int], uploader: Uploader) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.uploader = uploader
        self._rows: list[tuple[int, SequenceLength, list[int]]] = []
        self._key: tuple[int, ...] = ()
        self._edits: TokenEdits | None = None

    def compose(self, rows: Sequence[SequenceLength]) -> None:
        self._rows = []
        for i, seq in enumerate(rows):
            if seq.sampling.min_tokens > 1:
                ids = stop_token_ids(seq.sampling, self.eos_token_ids)
                if ids:
                    self._rows.append((i, seq, ids))
        self._key, self._edits = (), None

    def for_step(self) -> TokenEdits | None:
        """The mask of this step's draw (before the rows' lengths count its token)."""
        if not self._rows:
            return None
        active = [
            (i, ids)
            for i, seq, ids in self._rows
            if needs_stop_mask(seq.sampling, seq.num_tokens - seq.num_prompt_tokens)
        ]
        key = tuple(i for i, _ in active)
        if key != self._key:
            self._key = key
            self._edits = (
                stop_mask_edits([i for i, _ in active], [ids for _, ids in active], self.uploader)
                if active
                else None
            )
            if not active:
                self._rows = []  # lengths only grow: no row needs a mask again
        return self._edits


@dataclass
class AllowedTokens:
    """Rows ``batch_rows`` may draw only the tokens set in their ``bitmask`` rows; a row
    with a gate (``gate_tokens`` not -1) only if its token of the step before is the gate."""

    batch_rows: torch.Tensor  # [r] int64
    bitmask: torch.Tensor  # [r, words] int32: bit j of word i allows token 32 * i + j
    gate_tokens: torch.Tensor | None = None  # [r] int64
    previous_tokens: torch.Tensor | None = None  # [r] int64, read by ``open_gates``

    def open_gates(self, last_tokens: torch.Tensor, sample_slot: torch.Tensor) -> None:
        """Read each gated row's token before (``last_tokens`` at its slot, ``sample_slot``
        per sampling row), on the device (no sync): its mask holds only if that is its gate."""
        if self.gate_tokens is not None:
            slots = sample_slot.index_select(0, self.batch_rows)
            self.previous_tokens = last_tokens.index_select(0, slots)

    def apply(self, logits: torch.Tensor) -> None:
        """Set the other tokens' logits of ``logits [N, vocab]`` (float32) to -inf, in place."""
        kernels.apply_token_bitmask(
            logits, self.batch_rows, self.bitmask, self.gate_tokens, self.previous_tokens
        )


def allowed_tokens(
    masked_seq_ids: Sequence[int],
    token_bitmask: bytes,
    samplers: Sequence[HasSeqId],
    vocab_size: int,
    uploader: Uploader,
) -> AllowedTokens | None:
    """The step's grammar masks, for the sampling rows ``samplers``, or None."""
    if not masked_seq_ids:
        return None
    row_of = {seq.seq_id: i for i, seq in enumerate(samplers)}
    try:
        rows = [row_of[seq_id] for seq_id in masked_seq_ids]
    except KeyError as exc:
        raise ValueError(f"a token mask for seq {exc.args[0]}, which samples no token") from None
    words = np.frombuffer(token_bitmask, dtype="<i4")
    if len(words) % len(rows) or (len(words) // len(rows)) * 32 < vocab_size:
        raise ValueError(
            f"a token bitmask of {len(words)} words for {len(rows)} rows of {vocab_size} tokens"
        )
    arrays = [
        np.asarray(rows, dtype=np.int64),
        words.astype(np.int32, copy=False).reshape(len(rows), -1),
    ]
    batch_rows, bitmask = uploader.upload(arrays)
    return AllowedTokens(batch_rows, bitmask)


class HasFirstMask(Protocol):
    """What ``first_masks`` reads of a sequence (worker_proc/batch.py's SequenceState)."""

    seq_id: int
    sampling: SamplingParams
    first_mask: torch.Tensor | None


def first_masks(
    gated_seq_ids: Sequence[int], samplers: Sequence[HasFirstMask], uploader: Uploader
) -> AllowedTokens:
    """The first masks of the step's rows whose grammar may wake (``StepPlan.gated_seq_ids``),
    each gated on the token that wakes it; the masks came once, with the sequences."""
    row_of = {seq.seq_id: i for i, seq in enumerate(samplers)}
    rows, masks, gates = [], [], []
    for seq_id in gated_seq_ids:
        row = row_of.get(seq_id)
        if row is None:
            raise ValueError(f"a gated mask for seq {seq_id}, which samples no token")
        seq = samplers[row]
        structured = seq.sampling.structured
        if seq.first_mask is None or structured is None or structured.after_token_id < 0:
            raise ValueError(f"seq {seq_id} has no grammar waiting for a token")
        rows.append(row)
        masks.append(seq.first_mask)
        gates.append(structured.after_token_id)
    batch_rows, gate_tokens = uploader.upload(
        [np.asarray(rows, dtype=np.int64), np.asarray(gates, dtype=np.int64)]
    )
    return AllowedTokens(batch_rows, torch.stack(masks), gate_tokens)
