"""Logprobs for the sequences that ask for them, computed on the device beside sampling.

As vLLM reports by default, logprobs come from the raw logits: ``log_softmax`` in float32,
before temperature, penalties and top-k/top-p. For each sampled token: its logprob and the
``k`` best alternatives and its rank in the vocabulary. For prompt logprobs (``prompt_logprobs``,
or completions' ``echo`` with ``logprobs``): every prompt token predicted by this step's
positions, the first prompt token with NaN (nothing predicts it).

Nothing here synchronizes with the device: the values are copied to (pinned) host memory
asynchronously, queued before the step's result event, so they are on the host once that
result is; ``attach`` fills them into the results as they are polled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pegainfer.protocol import StepResult, TokenLogprobs, pack_floats, pack_ids
from worker_proc.batch import SequenceState, StepLayout

# Prompt positions turned into full-vocabulary logits at once (bounds the transient memory).
PROMPT_CHUNK_ROWS = 256


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type == "cuda":
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host
    return tensor


def top_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [N, vocab]``, ``targets [N]`` -> the targets' logprobs ``[N]`` and ranks
    ``[N]`` (1 + the tokens strictly likelier), and the top ``k`` ids ``[N, k]`` and
    logprobs ``[N, k]``, best first (all on the device)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.long().view(-1, 1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1, dtype=torch.int32) + 1
    if k > 0:
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
    else:
        top_values = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = torch.empty((logprobs.shape[0], 0), dtype=torch.int64, device=logits.device)
    return chosen, ranks, top_ids, top_values


@dataclass
class _Piece:
    """Logprobs of some tokens of one sequence, on their way to the host."""

    seq_id: int
    start: int
    num_top: int
    token_ids: torch.Tensor  # [n]
    logprobs: torch.Tensor  # [n]
    ranks: torch.Tensor  # [n]
    top_ids: torch.Tensor  # [n, >= num_top]
    top_logprobs: torch.Tensor  # [n, >= num_top]

    def record(self) -> TokenLogprobs:
        k = self.num_top
        return TokenLogprobs(
            start=self.start,
            token_ids=pack_ids(self.token_ids.to(torch.int32).numpy()),
            logprobs=pack_floats(self.logprobs.float().numpy()),
            num_top=k,
            top_ids=pack_ids(self.top_ids[:, :k].to(torch.int32).numpy().reshape(-1)),
            top_logprobs=pack_floats(self.top_logprobs[:, :k].float().numpy().reshape(-1)),
            ranks=pack_ids(self.ranks.to(torch.int32).numpy()),
        )


@dataclass
class _StepJob:
    sampled: list[_Piece] = field(default_factory=list)
    prompt: list[_Piece] = field(default_factory=list)


def wants_prompt_hidden(seq: SequenceState, num_computed: int) -> bool:
    """Whether a step that starts at ``num_computed`` of ``seq`` has prompt logprobs to
    give (``LogprobsCollector.prompt_step``): the first position's entry, or a prompt token
    that one of the step's positions predicts."""
    if seq.sampling.prompt_logprobs is None:
        return False
    return num_computed == 0 or num_computed < seq.num_prompt_tokens - 1


class LogprobsCollector:
    def __init__(self, vocab_size: int) -> None:
        self._jobs: dict[int, _StepJob] = {}
        # A count of top logprobs past it (--max-logprobs -1) means the whole vocabulary.
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self._jobs)

    def sampled_step(
        self,
        step_id: int,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        samplers: list[SequenceState],
    ) -> None:
        """Logprobs of the tokens just sampled (row i of ``logits`` and ``tokens`` is
        ``samplers[i]``), for the rows that asked."""
        rows = [i for i, seq in enumerate(samplers) if seq.sampling.logprobs is not None]
        if not rows:
            return
        k = min(max(samplers[i].sampling.logprobs or 0 for i in rows), self.vocab_size)
        index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        targets = tokens.index_select(0, index)
        chosen, ranks, top_ids, top_values = top_logprobs(logits.index_select(0, index), targets, k)
        host = [_to_host(t) for t in (targets, chosen, ranks, top_ids, top_values)]
        job = self._jobs.setdefault(step_id, _StepJob())
        for j, i in enumerate(rows):
            seq = samplers[i]
            job.sampled.append(
                _Piece(
                    seq.seq_id,
                    0,  # the scheduler knows the output index
                    min(seq.sampling.logprobs or 0, k),
                    host[0][j : j + 1],
                    host[1][j : j + 1],
                    host[2][j : j + 1],
                    host[3][j : j + 1],
                    host[4][j : j + 1],
                )
            )

    def prompt_step(
        self,
        step_id: int,
        hidden: torch.Tensor,
        seqs: list[SequenceState],
        layout: StepLayout,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Logprobs of the prompt tokens this step's positions predict, for the sequences
        that asked. ``hidden`` holds the step's flat hidden states."""
        for row, seq in enumerate(seqs):
            k = seq.sampling.prompt_logprobs
            if k is None:
                continue
            k = min(k, self.vocab_size)
            flat_start = int(layout.query_start_loc[row])
            flat_end = int(layout.query_start_loc[row + 1])
            start = int(layout.positions[flat_start])  # the first position computed
            end = start + (flat_end - flat_start)
            last_target = min(end, seq.num_prompt_tokens - 1)  # the sampled token is not one
            targets = list(range(start + 1, last_target + 1))
            if start == 0:
                self._first_token(step_id, seq, k, hidden)
            if not targets:
                continue
            target_ids = torch.tensor([seq.token_ids[t] for t in targets], dtype=torch.int64)
            target_ids = target_ids.to(hidden.device, non_blocking=True)
            # Position t - 1 predicts token t.
            first_row = flat_start + targets[0] - 1 - start
            for offset in range(0, len(targets), PROMPT_CHUNK_ROWS):
                count = min(PROMPT_CHUNK_ROWS, len(targets) - offset)
                rows = hidden[first_row + offset : first_row + offset + count]
                chosen, ranks, top_ids, top_values = top_logprobs(
                    compute_logits(rows), target_ids[offset : offset + count], k
                )
                self._jobs.setdefault(step_id, _StepJob()).prompt.append(
                    _Piece(
                        seq.seq_id,
                        targets[offset],
                        k,
                        *(
                            _to_host(t)
                            for t in (
                                target_ids[offset : offset + count],
                                chosen,
                                ranks,
                                top_ids,
                                top_values,
                            )
                        ),
                    )
                )

    def _first_token(self, step_id: int, seq: SequenceState, k: int, like: torch.Tensor) -> None:
        self._jobs.setdefault(step_id, _StepJob()).prompt.append(
            _Piece(
                seq.seq_id,
                0,
                k,
                torch.tensor([seq.token_ids[0]], dtype=torch.int64),
                torch.tensor([float("nan")]),
                torch.zeros(1, dtype=torch.int32),
                torch.full((1, k), -1, dtype=torch.int64),
                torch.full((1, k), float("nan")),
            )
        )

    def attach(self, results: list[StepResult]) -> list[StepResult]:
        """Fill the logprobs of these (polled, hence complete) results."""
        if not self._jobs:
            return results
        for result in results:
            job = self._jobs.pop(result.step_id, None)
            if job is None:
                continue
            result.logprob_seq_ids = pack_ids([piece.seq_id for piece in job.sampled])
            result.logprobs = [piece.record() for piece in job.sampled]
            prompt = _merge_by_sequence(job.prompt)
            result.prompt_logprob_seq_ids = pack_ids([piece.seq_id for piece in prompt])
            result.prompt_logprobs = [piece.record() for piece in prompt]
        return results

    def drop(self, step_id: int) -> None:
        self._jobs.pop(step_id, None)


def _merge_by_sequence(pieces: list[_Piece]) -> list[_Piece]:
    """One piece per sequence: a sequence's pieces of one step are consecutive spans."""
    grouped: dict[int, list[_Piece]] = {}
    for piece in pieces:
        grouped.setdefault(piece.seq_id, []).append(piece)
    merged = []
    for group in grouped.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        group.sort(key=lambda piece: piece.start)
        merged.append(
            _Piece(
                group[0].seq_id,
                group[0].start,
                group[0].num_top,
                torch.cat([piece.token_ids.cpu() for piece in group]),
                torch.cat([piece.logprobs.cpu().float() for piece in group]),
                torch.cat([piece.ranks.cpu() for piece in group]),
                torch.cat([piece.top_ids.cpu() for piece in group]),
                torch.cat([piece.top_logprobs.cpu().float() for piece in group]),
            )
        )
    return merged
