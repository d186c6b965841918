"""Step results on their way from the device to the host.

After a step samples, its token ids are copied into pinned host memory asynchronously and
an event is recorded behind the copy. The step's result is ready when that event has
completed; meanwhile the host is free to build and launch the next step. Results come out
in step order. On the CPU there is nothing to wait for: a result is ready at once.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from kernels.host_copy import copy_pinned, tokens_out
from pegainfer.protocol import StepResult, pack_ids
from worker_proc.batch import SequenceState


@dataclass
class _Pending:
    step_id: int
    seqs: list[SequenceState]  # the sequences that sampled, in batch order
    host_tokens: torch.Tensor | None  # [len(seqs)] on the host, maybe still filling
    event: torch.cuda.Event | None


class ResultQueue:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pending: deque[_Pending] = deque()

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def oldest_step_id(self) -> int | None:
        return self._pending[0].step_id if self._pending else None

    def push(
        self,
        step_id: int,
        seqs: list[SequenceState],
        tokens: torch.Tensor | None,
        last_token: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Queue step ``step_id``'s result: ``tokens [len(seqs)]`` (device) sampled for
        ``seqs``; None when the step sampled nothing. With ``last_token`` and ``slots`` the
        tokens are also written to ``last_token[slots]``, in the launch that copies them out."""
        if tokens is None or not seqs:
            self._pending.append(_Pending(step_id, [], None, None))
            return
        if self.device.type == "cuda":
            # Copied as they are (int64 from the sampler): a cast on the device would be one
            # more kernel between two steps; the host packs them as int32 anyway.
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            # A kernel writing the pinned memory (kernels/host_copy.py).
            if last_token is not None and slots is not None:
                tokens_out(host, tokens, last_token, slots)
            else:
                copy_pinned(host, tokens)
            event = torch.cuda.Event()
            event.record()
            self._pending.append(_Pending(step_id, seqs, host, event))
            return
        if last_token is not None and slots is not None:
            last_token.index_copy_(0, slots, tokens)
        # A copy: the tokens may be a view of a graph's buffer, which the next step reuses.
        self._pending.append(_Pending(step_id, seqs, tokens.clone(), None))

    def poll(self, wait: bool = False) -> list[StepResult]:
        """The results whose tokens have reached the host, oldest first; with ``wait``, all
        of them. Each sampled token is appended to its sequence's host tokens."""
        results = []
        while self._pending:
            pending = self._pending[0]
            if pending.event is not None:
                if wait:
                    pending.event.synchronize()
                elif not pending.event.query():
                    break
            self._pending.popleft()
            results.append(self._finish(pending))
        return results

    @staticmethod
    def _finish(pending: _Pending) -> StepResult:
        if pending.host_tokens is None:
            return StepResult(step_id=pending.step_id, seq_ids=b"", token_ids=b"")
        tokens = pending.host_tokens.numpy()
        # A sequence dropped since (finished, aborted, preempted) still gets its token in
        # the result; the scheduler discards it.
        for seq, token in zip(pending.seqs, tokens.tolist()):
            seq.token_ids.append(token)
        return StepResult(
            step_id=pending.step_id,
            seq_ids=pack_ids([s.seq_id for s in pending.seqs]),
            token_ids=pack_ids(tokens),
        )
