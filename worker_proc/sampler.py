"""Batched sampling of the next token from float32 logits.

Per row: repetition, presence and frequency penalties first (they apply to greedy rows
too); then temperature below ``GREEDY_TEMPERATURE`` means greedy argmax; otherwise the logits
are divided by the temperature, filtered by top-k, top-p and min-p (in that order, each on
what the previous one left), and one token is drawn.

Drawing uses the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)`` per vocabulary
entry), which samples exactly from ``p`` and lets every row's randomness come from its own
generator: a seeded request draws a full row from its private generator each step, so its
tokens do not depend on what else is in the batch; unseeded rows share one generator. The
whole batch stays on the device; the caller syncs once, when it reads the tokens.
"""

from __future__ import annotations

import torch

from pegainfer.protocol import SamplingParams

GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_TEMPERATURE


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)

    def make_generator(self, params: SamplingParams) -> torch.Generator | None:
        """A private generator for a seeded, non-greedy request; created once per request."""
        if params.seed is None or is_greedy(params):
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(params.seed)
        return generator

    def _row_tensor(self, values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _filter(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Set the logits of tokens outside top-k / top-p / min-p to -inf."""
        vocab = logits.shape[-1]
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        top_ps = [min(max(p.top_p, 0.0), 1.0) for p in params]
        use_top_k = any(k < vocab for k in top_ks)
        use_top_p = any(p < 1.0 for p in top_ps)
        if use_top_k or use_top_p:
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
            if use_top_k:
                ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
                k = self._row_tensor(top_ks, torch.int64).unsqueeze(1)
                sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
            if use_top_p:
                probs = sorted_logits.softmax(dim=-1)
                # Mass strictly before each token; the most likely token always stays.
                mass_before = probs.cumsum(dim=-1) - probs
                p = self._row_tensor(top_ps, torch.float32).unsqueeze(1)
                sorted_logits = sorted_logits.masked_fill(mass_before > p, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
        min_ps = [p.min_p for p in params]
        if any(m > 0.0 for m in min_ps):
            probs = logits.softmax(dim=-1)
            threshold = self._row_tensor(min_ps, torch.float32).unsqueeze(1)
            threshold = threshold * probs.max(dim=-1, keepdim=True).values
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
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        histories: list[tuple[list[int], int]] | None = None,
    ) -> torch.Tensor:
        """``logits [N, vocab]`` float32 -> token ids ``[N]`` int64 on the device.

        ``histories`` gives each row's ``(token_ids, num_prompt_tokens)``; it is needed
        only when some row has a repetition, presence or frequency penalty.
        """
        if histories is not None:
            logits = self._apply_penalties(logits, params, histories)
        greedy_tokens = logits.argmax(dim=-1)
        greedy = [is_greedy(p) for p in params]
        if all(greedy):
            return greedy_tokens
        temperatures = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        scaled = logits / self._row_tensor(temperatures, torch.float32).unsqueeze(1)
        probs = self._filter(scaled, params).softmax(dim=-1)

        noise = torch.empty_like(probs)
        shared_rows = []
        for row, (generator, row_is_greedy) in enumerate(zip(generators, greedy)):
            if row_is_greedy:
                continue
            if generator is None:
                shared_rows.append(row)
            else:
                noise[row].exponential_(generator=generator)
        if shared_rows:
            shared_noise = torch.empty(
                (len(shared_rows), probs.shape[1]), dtype=probs.dtype, device=probs.device
            ).exponential_(generator=self.shared_generator)
            noise[self._row_tensor(shared_rows, torch.int64)] = shared_noise
        # Clamp so a zero draw cannot turn a masked (zero-probability) entry into 0/0.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        sampled = probs.div(noise).argmax(dim=-1)
        return torch.where(self._row_tensor(greedy, torch.bool), greedy_tokens, sampled)
