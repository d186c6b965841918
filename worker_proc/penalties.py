"""Repetition, presence and frequency penalties from per-sequence token counts kept on the
device.

Each live sequence with a penalty holds a row of two tables: which tokens its prompt holds
and how often each token has been generated. The row is filled once, at admission, from the
tokens the plan sent (a preempted sequence's generated tokens count as generated), and each
step adds the token just sampled, on the device. So a penalised row needs no history from
the host and the step never waits for the tokens still in flight: overlapped scheduling
goes on as for any other request.

Penalties, OpenAI and vLLM style: the repetition penalty divides a positive logit (or
multiplies a negative one) of every token seen in the prompt or the output; presence and
frequency penalties subtract ``presence * (count > 0) + frequency * count`` over the output.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from worker_proc.upload import Uploader

logger = logging.getLogger(__name__)

MIN_ROWS = 8


class PenaltyTable:
    """Rows of (prompt tokens seen, generated token counts), one per penalised sequence."""

    def __init__(self, vocab_size: int, device: torch.device, uploader: Uploader) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.uploader = uploader
        self.prompt_seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    @property
    def rows_in_use(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self) -> None:
        old = self.capacity
        new = max(MIN_ROWS, 2 * old)
        seen = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        seen[:old] = self.prompt_seen
        counts[:old] = self.counts
        self.prompt_seen, self.counts = seen, counts
        self._free.extend(range(new - 1, old - 1, -1))  # lowest row first
        logger.info(
            "penalty table: %d rows (%.1f MiB) for sequences with penalties",
            new,
            new * self.vocab_size * 5 / 2**20,
        )

    def admit(self, token_ids: list[int], num_prompt_tokens: int) -> int:
        """A row for a new sequence: its prompt's tokens seen, its generated ones counted."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        prompt, output = self.uploader.upload(
            [
                np.asarray(token_ids[:num_prompt_tokens], dtype=np.int64),
                np.asarray(token_ids[num_prompt_tokens:], dtype=np.int64),
            ]
        )
        seen, counts = self.prompt_seen[row], self.counts[row]
        seen.zero_()
        counts.zero_()
        if len(prompt):
            seen.index_fill_(0, prompt, True)
        if len(output):
            counts.index_add_(0, output, torch.ones_like(output, dtype=torch.int32))
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each row's newly sampled token (``rows`` distinct, ``[p]`` each)."""
        ones = torch.ones_like(tokens, dtype=torch.int32)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)

    def apply(
        self,
        logits: torch.Tensor,
        batch_rows: torch.Tensor,
        rows: torch.Tensor,
        repetition: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
    ) -> torch.Tensor:
        """``logits [N, vocab]`` float32 with the penalties of batch rows ``batch_rows``
        (table rows ``rows``; each setting ``[p, 1]``) applied, as a new tensor."""
        penalised = logits.index_select(0, batch_rows)
        counts = self.counts.index_select(0, rows)
        generated = counts > 0
        seen = self.prompt_seen.index_select(0, rows) | generated
        scaled = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
        penalised = torch.where(seen & (repetition != 1.0), scaled, penalised)
        penalised = penalised - frequency * counts.to(penalised.dtype) - presence * generated
        return logits.index_copy(0, batch_rows, penalised)


def penalty_arrays(params: list) -> list[np.ndarray]:
    """(repetition, presence, frequency) of each penalised row, as ``[p, 1]`` float32."""
    return [
        np.asarray([[p.repetition_penalty] for p in params], dtype=np.float32),
        np.asarray([[p.presence_penalty] for p in params], dtype=np.float32),
        np.asarray([[p.frequency_penalty] for p in params], dtype=np.float32),
    ]
