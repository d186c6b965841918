"""Batched sampling of the next token from float32 logits, on the device.

Per row: ``logit_bias`` (one-token bad words among it), the step's bans of longer bad
words, ``allowed_token_ids``, the ``min_tokens`` mask and the grammar masks first
(worker_proc/logit_edits.py), then repetition, presence and frequency penalties (from token
counts kept on the device, worker_proc/penalties.py); all apply to greedy rows too. Then
temperature below ``GREEDY_TEMPERATURE`` means greedy argmax; otherwise the logits are
scaled by the inverse temperature, filtered by top-k, top-p and min-p (in that order, each on
what the previous one left), and one token is drawn.

Per-row settings become device tensors once per batch composition (``prepare``), not once
per step: a decode batch keeps its composition for many steps. ``sample`` then issues only
device work; the caller copies the tokens back once, asynchronously.

A draw is the Gumbel-max race: ``argmax(s_i - log E_i)`` over the row's scores ``s`` (cut
tokens at -inf), with ``E_i ~ Exp(1)``, samples exactly from ``softmax(s)``. ``E`` is a
counter-based hash of (key, position, vocabulary index) (worker_proc/sampling_noise.py): a
seeded row's key comes from its seed, an unseeded row's from the sampler's call count, so
no generator state lives on the device.

Four paths, each row's set by its own settings (so a seeded row draws the same token
whatever batch it is in):
- no filter (temperature alone, the API's default): one pass over the row, the race kernel
  (kernels/sampling_race.py), which makes the noise as it reads;
- top-k of at most ``CANDIDATES`` (Qwen3's recommended 20, say): the row's ``CANDIDATES``
  largest scores are found (kernels/top_candidates.py, two passes over the row), and the cuts
  and the draw run over those alone;
- top-p or min-p without top-k: the race over the row searched for its cut without a sort
  (kernels/sampling_nucleus.py), two or three passes over the row;
- a top-k past ``CANDIDATES``: over the whole row in torch (a sort with top-p), then the
  race.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from kernels.sampling_candidates import race_candidates
from kernels.sampling_nucleus import TOP_P_OFF, race_nucleus
from kernels.sampling_race import race_rows
from kernels.top_candidates import top_candidates
from pegainfer.protocol import SamplingParams
from worker_proc.logit_edits import (
    AllowedTokens,
    GatedBans,
    KeepOnly,
    TokenEdits,
    bias_edits,
    keep_only_edits,
)
from worker_proc.penalties import PenaltyTable, penalty_arrays
from worker_proc.sampling_noise import (
    mix32,
    mix32_int,
    seed_key,
    seeded_exponentials,
)
from worker_proc.upload import Uploader

__all__ = [
    "CANDIDATES",
    "GREEDY_TEMPERATURE",
    "RowGroup",
    "Sampler",
    "PenalisedRows",
    "SamplingBatch",
    "has_penalties",
    "is_greedy",
    "mix32",
    "mix32_int",
    "seed_key",
    "seeded_exponentials",
]

GREEDY_TEMPERATURE = 1e-5
# A row with top-k of at most this many is drawn from its CANDIDATES largest scores. The
# width is fixed, not the batch's largest top-k, so a row's arithmetic (its softmax and
# cumulative sums over these entries) does not depend on the other rows.
CANDIDATES = 128
# top_p of 1 (off) in a row beside top-p rows: a cumulative mass rounded past 1.0 must not
# cut that row's last tokens.
_TOP_P_OFF = TOP_P_OFF
_NO_SEED = -1


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def has_filters(params: SamplingParams, vocab_size: int) -> bool:
    return 0 < params.top_k < vocab_size or params.top_p < 1.0 or params.min_p > 0.0


@dataclass
class RowGroup:
    """Sampled rows of a batch that take the same path, their settings as device tensors."""

    path: str  # "race" (no filter), "candidates", "nucleus" or "filtered"
    rows: torch.Tensor | None  # [n] rows of the batch; None: every row, in order
    inv_temperatures: torch.Tensor  # [n] float32
    keys: torch.Tensor  # [n] int64: the seed's 32-bit key, or -1
    top_k: torch.Tensor | None  # [n, 1] int64, 0 where off; None when no row uses it
    max_top_k: int
    top_p: torch.Tensor | None  # [n, 1]; None when no row uses it (always there: nucleus)
    min_p: torch.Tensor | None  # [n, 1]; None when no row uses it (always there: nucleus)


@dataclass
class PenalisedRows:
    """The batch rows with a penalty, their penalty-table rows and settings, on the device."""

    batch_rows: torch.Tensor  # [p] int64
    table_rows: torch.Tensor  # [p] int64
    repetition: torch.Tensor  # [p, 1] float32
    presence: torch.Tensor  # [p, 1]
    frequency: torch.Tensor  # [p, 1]


@dataclass
class SamplingBatch:
    """The sampling settings of one batch composition, as device tensors."""

    params: list[SamplingParams]
    all_greedy: bool
    greedy: torch.Tensor | None  # [N] bool; None when no row is greedy
    groups: list[RowGroup]
    penalised_rows: list[int]
    penalised: PenalisedRows | None = None
    bias: TokenEdits | None = None  # the rows' logit_bias
    keep: KeepOnly | None = None  # the rows' allowed_token_ids

    @property
    def num_rows(self) -> int:
        return len(self.params)


def _group_arrays(
    rows: list[int], params: list[SamplingParams], top_ks: list[int]
) -> list[np.ndarray]:
    top_ps = [min(max(params[i].top_p, 0.0), 1.0) for i in rows]
    seeds = [params[i].seed for i in rows]
    return [
        np.asarray(rows, dtype=np.int64),
        1.0 / np.asarray([params[i].temperature for i in rows], dtype=np.float32),
        np.asarray([_NO_SEED if s is None else seed_key(s) for s in seeds], dtype=np.int64),
        np.asarray([top_ks[i] for i in rows], dtype=np.int64),
        np.asarray([p if p < 1.0 else _TOP_P_OFF for p in top_ps], dtype=np.float32),
        np.asarray([max(params[i].min_p, 0.0) for i in rows], dtype=np.float32),
    ]


def _group(path: str, arrays: list[np.ndarray], tensors: list[torch.Tensor], whole: bool):
    rows, inv_temps, keys, ks, ps, mps = tensors
    every = path == "nucleus"  # its kernel reads both settings of every row
    return RowGroup(
        path=path,
        rows=None if whole else rows,
        inv_temperatures=inv_temps,
        keys=keys,
        top_k=ks.unsqueeze(1) if arrays[3].any() else None,
        max_top_k=int(arrays[3].max()),
        top_p=ps.unsqueeze(1) if every or (arrays[4] < 1.0).any() else None,
        min_p=mps.unsqueeze(1) if every or (arrays[5] > 0.0).any() else None,
    )


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, uploader: Uploader | None = None):
        self.device = device
        self.seed = seed
        self._seed_key = seed_key(seed)
        self._calls = 0
        self.uploader = uploader or Uploader(device, ring_size=2)

    def reseed(self) -> None:
        """Draw the unseeded rows' noise as from a fresh sampler."""
        self._calls = 0

    def _call_key(self) -> int:
        """This call's key for the unseeded rows, below 2**31 (kernels/sampling_race.py)."""
        self._calls += 1
        return mix32_int(self._seed_key ^ mix32_int(self._calls)) & 0x7FFFFFFF

    def prepare(
        self,
        params: list[SamplingParams],
        vocab_size: int,
        penalty_rows: list[int] | None = None,
    ) -> SamplingBatch:
        """Device tensors of every row's settings; reuse the result while the batch's rows
        (and so their settings) stay the same. ``penalty_rows``: each row's row of the
        penalty table (-1 where none); needed when a row has a penalty."""
        greedy = [is_greedy(p) for p in params]
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        penalised_rows = None
        if penalised:
            if penalty_rows is None or any(penalty_rows[i] < 0 for i in penalised):
                raise ValueError("rows with penalties need their rows of the penalty table")
            arrays = [
                np.asarray(penalised, dtype=np.int64),
                np.asarray([penalty_rows[i] for i in penalised], dtype=np.int64),
                *penalty_arrays([params[i] for i in penalised]),
            ]
            penalised_rows = PenalisedRows(*self.uploader.upload(arrays, persistent=True))
        bias = bias_edits(params, self.uploader)
        keep = keep_only_edits(params, self.uploader)
        if all(greedy):
            return SamplingBatch(params, True, None, [], penalised, penalised_rows, bias, keep)
        # 0: off. Greedy rows never use their filters.
        top_ks = [
            p.top_k if 0 < p.top_k < vocab_size and not g else 0 for p, g in zip(params, greedy)
        ]
        width = min(CANDIDATES, vocab_size)
        sampled = [i for i, g in enumerate(greedy) if not g]
        filtered = [i for i in sampled if has_filters(params[i], vocab_size)]
        paths = {
            "race": [i for i in sampled if i not in set(filtered)],
            "candidates": [i for i in filtered if 0 < top_ks[i] <= width],
            "nucleus": [i for i in filtered if top_ks[i] == 0],
            "filtered": [i for i in filtered if top_ks[i] > width],
        }
        paths = {path: rows for path, rows in paths.items() if rows}
        arrays: list[np.ndarray] = []
        if any(greedy):
            arrays.append(np.asarray(greedy, dtype=np.bool_))
        per_group = {path: _group_arrays(rows, params, top_ks) for path, rows in paths.items()}
        for group_arrays in per_group.values():
            arrays += group_arrays
        tensors = self.uploader.upload(arrays, persistent=True)
        greedy_mask = tensors.pop(0) if any(greedy) else None
        groups = []
        for path, rows in paths.items():
            group_tensors, tensors = tensors[:6], tensors[6:]
            whole = len(rows) == len(params)
            groups.append(_group(path, per_group[path], group_tensors, whole))
        return SamplingBatch(
            params, False, greedy_mask, groups, penalised, penalised_rows, bias, keep
        )

    def _race(
        self, logits: torch.Tensor, group: RowGroup, positions: torch.Tensor, call_key: int
    ) -> torch.Tensor:
        """Tokens drawn over the whole row, which no filter cuts: one pass over the logits
        as they are (the model's dtype)."""
        return race_rows(logits, group.inv_temperatures, group.keys, positions, call_key)

    def _draw_filtered(
        self, logits: torch.Tensor, group: RowGroup, positions: torch.Tensor, call_key: int
    ) -> torch.Tensor:
        """Tokens drawn over the whole row after its filters."""
        scores = self._filter(logits * group.inv_temperatures.unsqueeze(1), group)
        ones = torch.ones_like(group.inv_temperatures)
        return race_rows(scores, ones, group.keys, positions, call_key)

    def _draw_nucleus(
        self, logits: torch.Tensor, group: RowGroup, positions: torch.Tensor, call_key: int
    ) -> torch.Tensor:
        """Tokens drawn over the whole row after its top-p and min-p cuts, found without a
        sort (the logits as they are)."""
        assert group.top_p is not None and group.min_p is not None
        return race_nucleus(
            logits,
            group.inv_temperatures,
            group.top_p.view(-1),
            group.min_p.view(-1),
            group.keys,
            positions,
            call_key,
        )

    def _draw_candidates(
        self, logits: torch.Tensor, group: RowGroup, positions: torch.Tensor, call_key: int
    ) -> torch.Tensor:
        """Tokens drawn over each row's ``CANDIDATES`` largest scores (every row of the group
        has a top-k of at most that many, so nothing outside them can be drawn)."""
        assert group.top_k is not None
        # A positive scale keeps the order (distinct logits stay distinct in float32), so the
        # candidates are found among the logits as they are (the model's dtype, and no scaled
        # copy of the whole row), and only they are scaled.
        values, ids = top_candidates(logits, min(CANDIDATES, logits.shape[1]))  # descending
        values = values * group.inv_temperatures.unsqueeze(1)
        return race_candidates(
            values,
            ids,
            group.top_k.view(-1),
            None if group.top_p is None else group.top_p.view(-1),
            None if group.min_p is None else group.min_p.view(-1),
            group.keys,
            positions,
            call_key,
        )

    def _filter(self, logits: torch.Tensor, group: RowGroup) -> torch.Tensor:
        """Set the logits of tokens outside top-k / top-p / min-p to -inf."""
        if group.top_p is not None:
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
            if group.top_k is not None:
                ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
                cut = (ranks >= group.top_k) & (group.top_k > 0)
                sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # Mass strictly before each token; the most likely token always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(mass_before > group.top_p, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
        elif group.top_k is not None:
            # No full sort: the k-th largest value of each row is its cut; rows without
            # top-k cut at -inf, which keeps everything.
            top = logits.topk(group.max_top_k, dim=-1).values
            kth = top.gather(1, group.top_k.clamp(min=1) - 1)
            kth = torch.where(group.top_k > 0, kth, float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if group.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = group.min_p * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        positions: torch.Tensor | None = None,
        penalties: PenaltyTable | None = None,
        greedy_tokens: torch.Tensor | None = None,
        stop_mask: TokenEdits | None = None,
        allowed: AllowedTokens | None = None,
        bans: GatedBans | None = None,
        gated: AllowedTokens | None = None,
    ) -> torch.Tensor:
        """``logits [N, vocab]`` (the model's dtype or float32) -> token ids ``[N]`` int64
        on the device. Greedy rows take the argmax of the logits as they are (a float32 copy
        holds the same values); sampled rows are scored in float32.

        ``positions [N]`` int64 (device): the position of the token each row draws; needed
        when a row is seeded. ``penalties``: the table of the rows' token counts, needed
        when some row has a penalty; it counts the tokens drawn for those rows.
        ``greedy_tokens [N]``: the argmax of each row of ``logits`` where already taken
        (the decode graph takes it), used unless an edit or a penalty changes the logits.
        ``stop_mask``: this step's ``min_tokens`` mask (worker_proc/logit_edits.py); it and
        the rows' ``logit_bias`` edit a float32 copy of the logits, before the penalties.
        ``allowed``: the grammar masks of rows with structured output, applied last.
        ``bans``: the step's bans of longer bad words, gates decided (``open_gates``);
        ``gated``: the first masks of grammars that may wake this step, gates decided.
        """
        edits = (batch.bias, bans, batch.keep, stop_mask, allowed, gated)
        edits = [edit for edit in edits if edit is not None]
        if edits:
            logits = logits.to(torch.float32, copy=True)
            for edit in edits:
                edit.apply(logits)
            greedy_tokens = None
        penalised = batch.penalised
        if penalised is not None:
            if penalties is None:
                raise ValueError("rows with penalties need the penalty table")
            logits = penalties.apply(
                logits.float(),
                penalised.batch_rows,
                penalised.table_rows,
                penalised.repetition,
                penalised.presence,
                penalised.frequency,
            )
            greedy_tokens = None
            tokens = self._draw(logits, batch, positions, greedy_tokens)
            penalties.record(penalised.table_rows, tokens.index_select(0, penalised.batch_rows))
            return tokens
        return self._draw(logits, batch, positions, greedy_tokens)

    def _draw(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        positions: torch.Tensor | None,
        greedy_tokens: torch.Tensor | None,
    ) -> torch.Tensor:
        if batch.greedy is not None or batch.all_greedy:
            if greedy_tokens is None:
                greedy_tokens = kernels.argmax_rows(logits)
            if batch.all_greedy:
                return greedy_tokens
        if positions is None:
            if any(p.seed is not None for p in batch.params):
                raise ValueError("seeded rows need the positions of the tokens they draw")
            positions = torch.zeros(len(batch.params), dtype=torch.int64, device=self.device)
        positions = positions.to(self.device)
        call_key = self._call_key()
        tokens = greedy_tokens.clone() if greedy_tokens is not None else None
        for group in batch.groups:
            rows_logits = logits if group.rows is None else logits.index_select(0, group.rows)
            rows_positions = positions if group.rows is None else positions[group.rows]
            draw = {
                "race": self._race,
                "candidates": self._draw_candidates,
                "nucleus": self._draw_nucleus,
                "filtered": self._draw_filtered,
            }[group.path]
            drawn = draw(rows_logits, group, rows_positions, call_key)
            if group.rows is None:
                return drawn  # the one group, and every row of the batch
            if tokens is None:
                tokens = torch.empty(len(batch.params), dtype=torch.int64, device=self.device)
            tokens.index_copy_(0, group.rows, drawn)
        assert tokens is not None
        return tokens
