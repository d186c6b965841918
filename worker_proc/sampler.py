"""Batched sampling of the next token from float32 logits, on the device.

Per row: repetition, presence and frequency penalties first (they apply to greedy rows
too); then temperature below ``GREEDY_TEMPERATURE`` means greedy argmax; otherwise the logits
are divided by the temperature, filtered by top-k, top-p and min-p (in that order, each on
what the previous one left), and one token is drawn.

Per-row settings become device tensors once per batch composition (``prepare``), not once
per step: a decode batch keeps its composition for many steps. ``sample`` then issues only
device work; the caller copies the tokens back once, asynchronously.

Drawing uses the exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary
entry samples exactly from ``p``. Unseeded rows draw ``E`` from one shared generator. A
seeded row's ``E`` is a counter-based hash of (seed, position of the token being drawn,
vocabulary index), so its tokens depend on nothing else: not on the other rows of the batch,
not on how many steps ran before, and they repeat exactly when a preempted request is
recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kernels
from pegainfer.protocol import SamplingParams
from worker_proc.upload import Uploader

GREEDY_TEMPERATURE = 1e-5
_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: products of a 32-bit value stay below 2**63, so the int64
# arithmetic never overflows and CPU and GPU agree bit for bit.
_MUL_A = 0x7FEB352D
_MUL_B = 0x2C1B3C6D
_VOCAB_SALT = 0x5BD1E995


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def mix32_int(x: int) -> int:
    """``mix32`` of one Python int."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * _MUL_A) & _MASK32
    x ^= x >> 15
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A 64-bit (or negative) request seed folded into a 32-bit key."""
    seed &= (1 << 64) - 1
    return mix32_int(mix32_int(seed) ^ (seed >> 32))


def seeded_exponentials(
    keys: torch.Tensor, positions: torch.Tensor, vocab_salt: torch.Tensor
) -> torch.Tensor:
    """``Exp(1)`` noise ``[len(keys), vocab]``, a pure function of (key, position, index)."""
    row = mix32(keys ^ mix32(positions & _MASK32)).unsqueeze(1)
    bits = mix32(row ^ vocab_salt.unsqueeze(0))
    # 24 bits -> a float32 uniform strictly inside (0, 1).
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


@dataclass
class SamplingBatch:
    """The sampling settings of one batch composition, as device tensors."""

    params: list[SamplingParams]
    all_greedy: bool
    greedy: torch.Tensor | None  # [N] bool
    temperatures: torch.Tensor | None  # [N, 1]
    top_k: torch.Tensor | None  # [N, 1] int64, 0 where off; None when no row uses it
    max_top_k: int
    top_p: torch.Tensor | None  # [N, 1]; None when no row uses it
    min_p: torch.Tensor | None  # [N, 1]; None when no row uses it
    seeded_rows: torch.Tensor | None  # [Ns] rows with a seed (and not greedy)
    seed_keys: torch.Tensor | None  # [Ns] int64 32-bit keys
    num_seeded: int
    shared_rows: torch.Tensor | None  # [Nu] non-greedy rows without a seed
    num_shared: int
    penalised_rows: list[int]

    @property
    def num_rows(self) -> int:
        return len(self.params)


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
            index = torch.arange(vocab, dtype=torch.int64, device=self.device)
            self._vocab_salt = mix32(index ^ _VOCAB_SALT)
        return self._vocab_salt

    def prepare(self, params: list[SamplingParams], vocab_size: int) -> SamplingBatch:
        """Device tensors of every row's settings; reuse the result while the batch's rows
        (and so their settings) stay the same."""
        greedy = [is_greedy(p) for p in params]
        penalised = [i for i, p in enumerate(params) if has_penalties(p)]
        if all(greedy):
            return SamplingBatch(
                params, True, None, None, None, 0, None, None, None, None, 0, None, 0, penalised
            )
        # 0: off. Greedy rows never use their filters.
        top_ks = [
            p.top_k if 0 < p.top_k < vocab_size and not g else 0 for p, g in zip(params, greedy)
        ]
        top_ps = [min(max(p.top_p, 0.0), 1.0) for p in params]
        min_ps = [max(p.min_p, 0.0) for p in params]
        seeded = [i for i, p in enumerate(params) if not greedy[i] and p.seed is not None]
        shared = [i for i, p in enumerate(params) if not greedy[i] and p.seed is None]
        arrays = [
            np.asarray(greedy, dtype=np.bool_),
            np.asarray([1.0 if g else p.temperature for p, g in zip(params, greedy)], np.float32),
            np.asarray(top_ks, dtype=np.int64),
            np.asarray(top_ps, dtype=np.float32),
            np.asarray(min_ps, dtype=np.float32),
            np.asarray(seeded, dtype=np.int64),
            np.asarray([seed_key(params[i].seed) for i in seeded], dtype=np.int64),
            np.asarray(shared, dtype=np.int64),
        ]
        g, temps, ks, ps, mps, seeded_rows, keys, shared_rows = self.uploader.upload(
            arrays, persistent=True
        )
        return SamplingBatch(
            params=params,
            all_greedy=False,
            greedy=g,
            temperatures=temps.unsqueeze(1),
            top_k=ks.unsqueeze(1) if any(top_ks) else None,
            max_top_k=max(top_ks),
            top_p=ps.unsqueeze(1) if any(p < 1.0 for p in top_ps) else None,
            min_p=mps.unsqueeze(1) if any(m > 0.0 for m in min_ps) else None,
            seeded_rows=seeded_rows if seeded else None,
            seed_keys=keys if seeded else None,
            num_seeded=len(seeded),
            shared_rows=shared_rows if shared else None,
            num_shared=len(shared),
            penalised_rows=penalised,
        )

    def _filter(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Set the logits of tokens outside top-k / top-p / min-p to -inf."""
        if batch.top_p is not None:
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
            if batch.top_k is not None:
                ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
                cut = (ranks >= batch.top_k) & (batch.top_k > 0)
                sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # Mass strictly before each token; the most likely token always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(mass_before > batch.top_p, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
        elif batch.top_k is not None:
            # No full sort: the k-th largest value of each row is its cut; rows without
            # top-k cut at -inf, which keeps everything.
            top = logits.topk(batch.max_top_k, dim=-1).values
            kth = top.gather(1, batch.top_k.clamp(min=1) - 1)
            kth = torch.where(batch.top_k > 0, kth, float("-inf"))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if batch.min_p is not None:
            probs = logits.softmax(dim=-1)
            threshold = batch.min_p * probs.max(dim=-1, keepdim=True).values
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
        if greedy_tokens is None:
            greedy_tokens = kernels.argmax_rows(logits)
        if batch.all_greedy:
            return greedy_tokens
        assert batch.temperatures is not None and batch.greedy is not None
        probs = self._filter(logits / batch.temperatures, batch).softmax(dim=-1)
        noise = torch.ones_like(probs)
        if batch.num_shared:
            shared = torch.empty(
                (batch.num_shared, probs.shape[1]), dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.shared_generator)
            noise.index_copy_(0, batch.shared_rows, shared)
        if batch.num_seeded:
            if positions is None:
                raise ValueError("seeded rows need the positions of the tokens they draw")
            seeded = seeded_exponentials(
                batch.seed_keys,
                positions.to(probs.device).index_select(0, batch.seeded_rows),
                self._salt(probs.shape[1]),
            )
            noise.index_copy_(0, batch.seeded_rows, seeded)
        # Clamp so a zero draw cannot turn a masked (zero-probability) entry into 0/0.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        sampled = kernels.argmax_rows(probs.div(noise))
        return torch.where(batch.greedy, greedy_tokens, sampled)
