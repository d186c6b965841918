"""What the scheduler adds to its outputs for the detokenizer's sake, outside the policy.

- A request's sampling settings ride on its first output when its text depends on them
  (stop strings, special tokens, logprobs): the detokenizer learns them in order with the
  tokens, so there is no second channel to race with, and nothing to clean up for requests
  that never produce output.
- Logprobs the workers computed are attached to the output of the request that owns them.
  Prompt logprobs can arrive in a step where the request samples nothing (a prefill chunk),
  which then gets an output with no tokens.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pegainfer.protocol import (
    ProtocolError,
    SamplingParams,
    SeqOutput,
    StepResult,
    TokenLogprobs,
    unpack_ids,
)
from scheduler_proc.request import Request

logger = logging.getLogger(__name__)


def detokenizer_needs(sampling: SamplingParams) -> bool:
    """Whether the detokenizer must know these settings (else it uses the defaults)."""
    return bool(
        sampling.stop
        or not sampling.skip_special_tokens
        or sampling.logprobs is not None
        or sampling.prompt_logprobs is not None
        or sampling.starts_in_reasoning
    )


class OutputExtras:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        # Settings of accepted requests whose first output has not been sent yet.
        self._first_output_sampling: dict[str, SamplingParams] = {}
        # Queue times of requests started on the workers, until their first output.
        self._queue_times: dict[str, float] = {}

    @property
    def num_pending(self) -> int:
        return len(self._first_output_sampling) + len(self._queue_times)

    def on_admitted(self, request_id: str, sampling: SamplingParams) -> None:
        """A request the scheduler accepted into its waiting queue."""
        if detokenizer_needs(sampling):
            self._first_output_sampling[request_id] = sampling

    def forget(self, request_id: str) -> None:
        """A request refused after it was accepted: it will have no output."""
        self._first_output_sampling.pop(request_id, None)
        self._queue_times.pop(request_id, None)

    def on_planned(self, requests: list[Request]) -> None:
        """Requests that a plan starts on the workers for the first time."""
        now = self._clock()
        for request in requests:
            if request.num_preemptions == 0 and request.request_id not in self._queue_times:
                self._queue_times[request.request_id] = max(0.0, now - request.arrival_time)

    def owners(
        self, result: StepResult, request_of_seq: Callable[[int], Request | None]
    ) -> dict[int, Request]:
        """The requests that own the result's logprobs, looked up before the result is
        applied (applying it may finish them and retire their seq ids)."""
        if not result.logprobs and not result.prompt_logprobs:
            return {}
        owners = {}
        for packed in (result.logprob_seq_ids, result.prompt_logprob_seq_ids):
            try:
                seq_ids = unpack_ids(packed)
            except ProtocolError:
                continue  # reported when attaching
            for seq_id in seq_ids:
                request = request_of_seq(seq_id)
                if request is not None:
                    owners[seq_id] = request
        return owners

    def decorate(
        self,
        outputs: list[SeqOutput],
        result: StepResult | None = None,
        owners: dict[int, Request] | None = None,
    ) -> list[SeqOutput]:
        """Attach first-output settings and the result's logprobs; may add outputs."""
        if result is not None and owners:
            outputs = self._attach_logprobs(outputs, result, owners)
        if self._first_output_sampling:
            for output in outputs:
                sampling = self._first_output_sampling.pop(output.request_id, None)
                if sampling is not None:
                    output.sampling = sampling
        if self._queue_times:
            for output in outputs:
                output.queue_time = self._queue_times.pop(output.request_id, None)
        return outputs

    def _attach_logprobs(
        self, outputs: list[SeqOutput], result: StepResult, owners: dict[int, Request]
    ) -> list[SeqOutput]:
        by_request = {output.request_id: output for output in outputs}
        for packed, entries, prompt in (
            (result.logprob_seq_ids, result.logprobs, False),
            (result.prompt_logprob_seq_ids, result.prompt_logprobs, True),
        ):
            try:
                seq_ids = unpack_ids(packed)
            except ProtocolError as exc:
                logger.error("step %d: malformed logprob seq ids: %s", result.step_id, exc)
                continue
            if len(seq_ids) != len(entries):
                logger.error(
                    "step %d: %d logprob seq ids for %d entries",
                    result.step_id,
                    len(seq_ids),
                    len(entries),
                )
                continue
            for seq_id, entry in zip(seq_ids, entries):
                request = owners.get(seq_id)
                if request is None:
                    continue  # finished, aborted or preempted after the step was planned
                output = by_request.get(request.request_id)
                if output is None:
                    if not prompt or request.is_finished:
                        continue  # a sampled token's logprobs without its token: stale
                    output = request.to_output([])
                    outputs.append(output)
                    by_request[request.request_id] = output
                if prompt:
                    output.prompt_logprobs = entry
                elif output.new_token_ids:
                    output.logprobs = _with_start(entry, request.num_output_tokens - 1)
        return outputs


def _with_start(entry: TokenLogprobs, start: int) -> TokenLogprobs:
    """The worker does not know output indices (a preempted sequence restarts); the
    scheduler does: this token is the newest output token."""
    entry.start = max(start, 0)
    return entry
