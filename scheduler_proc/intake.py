"""Taking in a step's result: each sampled token appended to its request, stops checked,
one output per token for the detokenizer (``Scheduler.on_step_result``, or
``apply_step_result``, which leaves the finished requests' blocks to ``run_deferred``).

A part of ``Scheduler`` (scheduler.py), which owns the state named below; kept apart
because every decode step runs its loop over the whole batch, so it is written for speed:
locals only, and a per-request screen (``stop_screen``) in front of the full stop check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from pegainfer.protocol import ProtocolError, SeqOutput, StepResult, unpack_ids
from scheduler_proc.prefix_cache import PrefixCache
from scheduler_proc.request import Request
from scheduler_proc.stop import check_stop
from scheduler_proc.structured import ConstrainedRequests

# The scheduler's own logger: these lines have always come from it.
logger = logging.getLogger("scheduler_proc.scheduler")


class ResultIntake:
    # The Scheduler's state that taking in a result reads and changes.
    _in_flight: dict[int, list[int]]
    _seq_to_request: dict[int, Request]
    _clock: Callable[[], float]
    prefix_cache: PrefixCache | None
    constrained: ConstrainedRequests
    block_size: int
    eos_token_ids: frozenset[int]
    max_model_len: int
    generation_tokens_total: int
    prompt_tokens_total: int

    # Methods of the other parts (annotations only: nothing here shadows them).
    run_deferred: Callable[[], None]
    _finish: Callable[[Request, str, int | str | None], None]

    def on_step_result(self, result: StepResult) -> list[SeqOutput]:
        """``apply_step_result``, and the deferred bookkeeping (finished requests' blocks
        freed) at once."""
        outputs = self.apply_step_result(result)
        self.run_deferred()
        return outputs

    def apply_step_result(self, result: StepResult) -> list[SeqOutput]:
        """Take one step's sampled tokens: append them, check stops, report every change.
        The requests it finishes keep their blocks until the next ``run_deferred``, which the
        process calls once the outputs are sent."""
        self.run_deferred()
        samplers = self._in_flight.pop(result.step_id, None)
        if samplers is None:
            logger.warning("dropped a result for step %d, which is not in flight", result.step_id)
            return []
        try:
            seq_ids = unpack_ids(result.seq_ids)
            token_ids = unpack_ids(result.token_ids)
            if len(seq_ids) != len(token_ids):
                raise ProtocolError(f"{len(seq_ids)} seq ids but {len(token_ids)} tokens")
        except ProtocolError as exc:
            logger.error(
                "step %d result is malformed (%s); its tokens are lost", result.step_id, exc
            )
            seq_ids, token_ids = [], []
        now = self._clock()
        outputs: list[SeqOutput] = []
        if seq_ids == samplers:
            # The usual answer: one token for every sampler, in batch order, so none is
            # unexpected, repeated or missing.
            self._take_tokens(seq_ids, token_ids, now, outputs)
            return outputs
        expected = set(samplers)
        answered: set[int] = set()
        for seq_id, token_id in zip(seq_ids, token_ids):
            if seq_id not in expected or seq_id in answered:
                logger.warning("step %d: unexpected token for seq %d", result.step_id, seq_id)
                continue
            answered.add(seq_id)
            self._take_tokens((seq_id,), (token_id,), now, outputs)
        for seq_id in samplers:
            request = self._seq_to_request.get(seq_id)
            if seq_id not in answered and request is not None:
                # Its state no longer matches the worker's; ending it beats hanging it.
                logger.error(
                    "step %d sampled no token for request %s", result.step_id, request.request_id
                )
                self._finish(request, "abort", None)
                outputs.append(request.to_output([]))
        return outputs

    def _take_tokens(
        self,
        seq_ids: Sequence[int],
        token_ids: Sequence[int],
        now: float,
        outputs: list[SeqOutput],
    ) -> None:
        """Append each sampled token to the running request of its seq id, end those that
        stop, and report each in ``outputs``. A seq id no longer live is skipped: its
        request finished, was aborted or was preempted after the step was planned.

        Every decode step runs this loop over the whole batch: locals only, and the
        per-token stop test screened (``stop_screen``) before the full ``check_stop``."""
        seq_to_request = self._seq_to_request
        prefix_cache = self.prefix_cache
        block_size = self.block_size
        add_output = outputs.append
        num_taken = 0
        for seq_id, token_id in zip(seq_ids, token_ids):
            request = seq_to_request.get(seq_id)
            if request is None:
                continue
            num_taken += 1
            request.num_pending_tokens -= 1
            output_token_ids = request.output_token_ids
            output_token_ids.append(token_id)
            num_output = len(output_token_ids)
            num_prompt = request.num_prompt_tokens
            if request.grammar is not None:
                self.constrained.accept(request, token_id)
            if (
                prefix_cache is not None
                and not request.prefix_chain_broken
                and min(request.num_computed_tokens, num_prompt + num_output)
                >= (len(request.prefix_nodes) + 1) * block_size
            ):
                # A block whose last token was still in flight when its step was planned.
                # (The test is ``register``'s own early exit, made here to spare a call.)
                prefix_cache.register(request)
            if request.first_token_time is None:
                request.first_token_time = now
                self.prompt_tokens_total += num_prompt
            if token_id in request.stop_screen_ids or num_output >= request.stop_screen_length:
                stop = check_stop(
                    request.sampling,
                    output_token_ids,
                    num_prompt,
                    self.eos_token_ids,
                    self.max_model_len,
                )
                if stop is not None:
                    self._finish(request, *stop)
            add_output(request.token_output(token_id))
        self.generation_tokens_total += num_taken
