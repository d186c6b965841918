"""Batched sampling of the next token from float32 logits, on the device.

Per row: repetition, presence and frequency penalties first (they apply to greedy rows
too); then temperature below ``GREEDY_TEMPERATURE`` means greedy argmax; otherwise the logits
are divided by the temperature, filtered by top-k, top-p and min-p (in that order, each on
what the previous one left), and one token is drawn.

Per-row settings become device tensors once per batch composition (``prepare``), not once
per step: a decode batch keeps its composition for many steps. ``sample`` then issues only
device work; the caller copies the tokens back once, asynchronously.

Drawing uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary
entry samples exactly from ``p``. Unseeded rows draw ``E`` from one shared generator; a
seeded row's ``E`` is a counter-based hash of (seed, position, vocabulary index)
(worker_proc/sampling_noise.py).

Rows whose top-k is at most ``CANDIDATES`` (Qwen3's recommended 20, say) take the candidate
path: one ``topk`` finds each row's ``CANDIDATES`` largest scores, and the top-k, top-p and
min-p cuts and the draw run over those alone. Every other sampled row runs over its whole
vocabulary, sorting it only for top-p. Which path a row takes depends on its own settings
only, so a seeded row draws the same token whatever batch it is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from pegainfer.protocol import SamplingParams
from worker_proc.sampling_noise import (
    mix32,
    mix32_int,
    seed_key,
    seeded_exponentials,
    vocab_salt,
)
from worker_proc.upload import Uploader

__all__ = [
    "CANDIDATES",
    "GREEDY_TEMPERATURE",
    "RowGroup",
    "Sampler",
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
_TOP_P_OFF = 2.0


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


@dataclass
class RowGroup:
    """Sampled rows of a batch that take the same path, their settings as device tensors."""

    candidates: bool  # the candidate path (every row has 0 < top_k <= CANDIDATES)
    rows: torch.Tensor | None  # [n] rows of the batch; None: every row, in order
    num_rows: int
    temperatures: torch.Tensor  # [n, 1]
    top_k: torch.Tensor | None  # [n, 1] int64, 0 where off; None when no row uses it
    max_top_k: int
    top_p: torch.Tensor | None  # [n, 1]; None when no row uses it
    min_p: torch.Tensor | None  # [n, 1]; None when no row uses it
    seeded: torch.Tensor | None  # [ns] the seeded rows, as indices into the group
    seeded_batch_rows: torch.Tensor | None  # [ns] the same rows, as rows of the batch
    seed_keys: torch.Tensor | None  # [ns] int64 32-bit keys
    num_seeded: int
    shared: torch.Tensor | None  # [nu] rows without a seed, as indices into the group
    num_shared: int


@dataclass
class SamplingBatch:
    """The sampling settings of one batch composition, as device tensors."""

    params: list[SamplingParams]
    all_greedy: bool
    greedy: torch.Tensor | None  # [N] bool; None when no row is greedy
    groups: list[RowGroup]
    penalised_rows: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.params)


def _group_arrays(
    rows: list[int], params: list[SamplingParams], top_ks: list[int]
) -> list[np.ndarray]:
    top_ps = [min(max(params[i].top_p, 0.0), 1.0) for i in rows]
    seeded = [j for j, i in enumerate(rows) if params[i].seed is not None]
    return [
        np.asarray(rows, dtype=np.int64),
        np.asarray([params[i].temperature for i in rows], dtype=np.float32),
        np.asarray([top_ks[i] for i in rows], dtype=np.int64),
        np.asarray([p if p < 1.0 else _TOP_P_OFF for p in top_ps], dtype=np.float32),
        np.asarray([max(params[i].min_p, 0.0) for i in rows], dtype=np.float32),
        np.asarray(seeded, dtype=np.int64),
        np.asarray([rows[j] for j in seeded], dtype=np.int64),
        np.asarray([seed_key(params[rows[j]].seed) for j in seeded], dtype=np.int64),
        np.asarray([j for j, i in enumerate(rows) if params[i].seed is None], dtype=np.int64),
    ]


def _group(
    candidates: bool, arrays: list[np.ndarray], tensors: list[torch.Tensor], whole: bool
) -> RowGroup:
    rows, temps, ks, ps, mps, seeded, seeded_rows, keys, shared = tensors
    num_seeded, num_shared = len(arrays[5]), len(arrays[8])
    return RowGroup(
        candidates=candidates,
        rows=None if whole else rows,
        num_rows=len(arrays[0]),
        temperatures=temps.unsqueeze(1),
        top_k=ks.unsqueeze(1) if arrays[2].any() else None,
        max_top_k=int(arrays[2].max()),
        top_p=ps.unsqueeze(1) if (arrays[3] < 1.0).any() else None,
        min_p=mps.unsqueeze(1) if (arrays[4] > 0.0).any() else None,
        seeded=seeded if num_seeded else None,
        seeded_batch_rows=seeded_rows if num_seeded else None,
        seed_keys=keys if num_seeded else None,
        num_seeded=num_seeded,
        shared=shared if num_shared else None,
        num_shared=num_shared,
    )


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, uploader: Uploader | None = None):
        self.device = device
        self.seed = seed
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)
        self.uploader = uploader or Uploader(device, ring_size=2)
        self._vocab_salt: torch.Tensor | None = None

    def reseed(self) -> None:
        """Start the unseeded rows' generator over, as at construction."""
        self.shared_generator.manual_seed(self.seed)

    def _salt(self, vocab: int) -> torch.Tensor:
        if self._vocab_salt is None or self._vocab_salt.numel() != vocab:
            self._vocab_salt = vocab_salt(vocab, self.device)
        return self._vocab_salt

    def prepare(self, params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
        """Device tensors of every row's settings; reuse the result while the batch's rows
        (and so their settings) stay the same."""
        greedy = [is_greedy(p) for p in params]
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        if all(greedy):
            return SamplingBatch(params, True, None, [], penalised)
        # 0: off. Greedy rows never use their filters.
        top_ks = [
            p.top_k if 0 < p.top_k < vocab_size and not g else 0 for p, g in zip(params, greedy)
        ]
        width = min(CANDIDATES, vocab_size)
        sampled = [i for i, g in enumerate(greedy) if not g]
        paths = {
            True: [i for i in sampled if 0 < top_ks[i] <= width],
            False: [i for i in sampled if not 0 < top_ks[i] <= width],
        }
        arrays: list[np.ndarray] = []
        if any(greedy):
            arrays.append(np.asarray(greedy, dtype=np.bool_))
        per_group = {path: _group_arrays(rows, params, top_ks) for path, rows in paths.items()}
        for path, rows in paths.items():
            if rows:
                arrays += per_group[path]
        tensors = self.uploader.upload(arrays, persistent=True)
        greedy_mask = tensors.pop(0) if any(greedy) else None
        groups = []
        for path, rows in paths.items():
            if rows:
                group_tensors, tensors = tensors[:9], tensors[9:]
                whole = len(rows) == len(params)
                groups.append(_group(path, per_group[path], group_tensors, whole))
        return SamplingBatch(params, False, greedy_mask, groups, penalised)

    def _noise(
        self, shape: tuple[int, int], group: RowGroup, positions: torch.Tensor | None, salt
    ) -> torch.Tensor:
        """``Exp(1)`` noise for the group's rows; ``salt`` gives the seeded rows' vocabulary
        salts (``[vocab]``, or a callable of the seeded rows' indices into the group)."""
        seeded = None
        if group.num_seeded:
            if positions is None:
                raise ValueError("seeded rows need the positions of the tokens they draw")
            row_positions = positions.to(self.device).index_select(0, group.seeded_batch_rows)
            seeded = seeded_exponentials(group.seed_keys, row_positions, salt(group.seeded))
            if group.num_seeded == group.num_rows:
                return seeded
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        if group.num_shared:
            if group.num_shared == group.num_rows:
                noise.exponential_(generator=self.shared_generator)
            else:
                shared = torch.empty(
                    (group.num_shared, shape[1]), dtype=torch.float32, device=self.device
                ).exponential_(generator=self.shared_generator)
                noise.index_copy_(0, group.shared, shared)
            # A zero draw would turn a masked (zero-probability) entry into 0/0.
            noise.clamp_min_(torch.finfo(torch.float32).tiny)
        if seeded is not None:
            noise.index_copy_(0, group.seeded, seeded)
        return noise

    def _draw_full(
        self, scores: torch.Tensor, group: RowGroup, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Tokens drawn over the whole vocabulary of each row."""
        probs = self._filter(scores, group).softmax(dim=-1)
        salt = self._salt(scores.shape[1])
        noise = self._noise(tuple(probs.shape), group, positions, lambda _: salt)
        return kernels.argmax_rows(probs.div_(noise))

    def _draw_candidates(
        self, scores: torch.Tensor, group: RowGroup, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """Tokens drawn over each row's ``CANDIDATES`` largest scores (every row of the group
        has a top-k of at most that many, so nothing outside them can be drawn)."""
        assert group.top_k is not None
        values, ids = scores.topk(min(CANDIDATES, scores.shape[1]), dim=-1)  # descending
        ranks = torch.arange(values.shape[1], device=values.device).unsqueeze(0)
        values = values.masked_fill(ranks >= group.top_k, float("-inf"))
        if group.top_p is not None:
            probs = values.softmax(dim=-1)
            # Mass strictly before each token; the most likely token always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            values = values.masked_fill(mass_before > group.top_p, float("-inf"))
        if group.min_p is not None:
            probs = values.softmax(dim=-1)
            threshold = group.min_p * probs.amax(dim=-1, keepdim=True)
            values = values.masked_fill(probs < threshold, float("-inf"))
        probs = values.softmax(dim=-1)
        salt = self._salt(scores.shape[1])
        noise = self._noise(
            tuple(probs.shape), group, positions, lambda seeded: salt[ids.index_select(0, seeded)]
        )
        # torch's argmax, not kernels.argmax_rows: at this width the Triton kernel would
        # compile a variant of its own at the first such request.
        choice = probs.div_(noise).argmax(dim=-1, keepdim=True)
        return ids.gather(1, choice).squeeze(1)

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

    def _apply_penalties(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        histories: list[tuple[list[int], int]],
    ) -> torch.Tensor:
        """Repetition penalty over prompt and output tokens (positive logits divided, negative
        multiplied); presence and frequency penalties over output tokens, OpenAI style.
        Rows without penalties cost nothing; each penalised row copies its history over."""
        rows = [i for i, p in enumerate(params) if has_penalties(p)]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            p = params[i]
            token_ids, num_prompt_tokens = histories[i]
            row = logits[i]
            if p.repetition_penalty != 1.0 and token_ids:
                seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                seen[torch.tensor(token_ids, dtype=torch.int64).to(logits.device)] = True
                penalised = torch.where(
                    row > 0, row / p.repetition_penalty, row * p.repetition_penalty
                )
                row = torch.where(seen, penalised, row)
            output = token_ids[num_prompt_tokens:]
            if (p.presence_penalty or p.frequency_penalty) and output:
                ids = torch.tensor(output, dtype=torch.int64).to(logits.device)
                counts = torch.bincount(ids, minlength=vocab)[:vocab].to(row.dtype)
                row = row - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
            logits[i] = row
        return logits

    def sample(
        self,
        logits: torch.Tensor,
        batch: SamplingBatch,
        positions: torch.Tensor | None = None,
        histories: list[tuple[list[int], int]] | None = None,
        greedy_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``logits [N, vocab]`` (the model's dtype or float32) -> token ids ``[N]`` int64
        on the device. A greedy batch takes the argmax of the logits as they are (a float32
        copy holds the same values); any other is sampled in float32.

        ``positions [N]`` int64 (device): the position of the token each row draws; needed
        when a row is seeded. ``histories`` gives each row's ``(token_ids,
        num_prompt_tokens)``; needed only when some row has a penalty. ``greedy_tokens
        [N]``: the argmax of each row of ``logits`` where already taken (the decode graph
        takes it), used unless a penalty changes the logits.
        """
        if batch.penalised_rows:
            greedy_tokens = None
        if batch.all_greedy and not batch.penalised_rows:
            return greedy_tokens if greedy_tokens is not None else kernels.argmax_rows(logits)
        logits = logits.float()
        if batch.penalised_rows:
            if histories is None:
                raise ValueError("rows with penalties need their token histories")
            logits = self._apply_penalties(logits, batch.params, histories)
        if batch.greedy is not None or batch.all_greedy:
            if greedy_tokens is None:
                greedy_tokens = kernels.argmax_rows(logits)
            if batch.all_greedy:
                return greedy_tokens
            tokens = greedy_tokens.clone()
        else:
            tokens = torch.empty(len(batch.params), dtype=torch.int64, device=logits.device)
        for group in batch.groups:
            rows_logits = logits if group.rows is None else logits.index_select(0, group.rows)
            scores = rows_logits / group.temperatures
            draw = self._draw_candidates if group.candidates else self._draw_full
            drawn = draw(scores, group, positions)
            if group.rows is None:
                return drawn  # the one group, and every row of the batch
            tokens.index_copy_(0, group.rows, drawn)
        return tokens
