"""``bad_words``: token sequences a request may never write (vLLM's field).

The tokenizer process turns each word into the token sequences that write it
(``SamplingParams.bad_words_token_ids``). A one-token word is banned at every step by the
worker itself. A longer word bans its last token at a step whose output so far ends with
the rest of the word, as vLLM does (the output only: the prompt does not count). The
scheduler writes those bans into each step's plan; with two steps in flight the output's
last token is not known yet when the plan is made, so a ban on it is gated: the worker
applies it only if the row's token of the step before is the word's last-but-one token
(``StepPlan.ban_gates``), on the device. No step waits for a ban.
"""

from __future__ import annotations

from pegainfer.protocol import StepPlan, pack_ids
from scheduler_proc.request import Request


class BadWordBans:
    def __init__(self) -> None:
        # The requests not finished whose words have two tokens or more: while none,
        # planning skips every check.
        self._live: set[str] = set()

    @property
    def num_live(self) -> int:
        return len(self._live)

    @staticmethod
    def _multi_token(request: Request) -> bool:
        return any(len(word) > 1 for word in request.sampling.bad_words_token_ids)

    def add(self, request: Request) -> None:
        if self._multi_token(request):
            self._live.add(request.request_id)

    def drop(self, request_id: str) -> None:
        """A request leaves for good (finished, aborted or refused)."""
        self._live.discard(request_id)

    def mark(self, plan: StepPlan, requests: list[Request], samplers: list[int]) -> None:
        """Write the step's bans of the sampling rows into the plan."""
        sampling = set(samplers)
        seq_ids: list[int] = []
        token_ids: list[int] = []
        gates: list[int] = []
        for request in requests:
            if request.seq_id not in sampling or not self._multi_token(request):
                continue
            output = request.output_token_ids
            # The plan's own token and, when two steps are in flight, the one before it.
            in_flight = request.num_pending_tokens - 1
            for word in request.sampling.bad_words_token_ids:
                known = len(word) - 1 - in_flight  # the word's tokens the output must end with
                if len(word) < 2 or known < 0 or len(output) < known:
                    continue
                if known and output[-known:] != word[:known]:
                    continue
                seq_ids.append(request.seq_id)
                token_ids.append(word[-1])
                gates.append(word[-2] if in_flight else -1)
        if seq_ids:
            plan.ban_seq_ids = pack_ids(seq_ids)
            plan.ban_token_ids = pack_ids(token_ids)
            plan.ban_gates = pack_ids(gates)
