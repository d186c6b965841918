"""The detokenizer process: `python -m detokenizer_proc --run-dir DIR`.

Turns each step's new token ids (one TokenOutputs from the scheduler) into one TextOutputs
for the frontend. Per-request state is created on first sight of a request id and dropped
when the request finishes.

Stop strings are matched here, on text. A request's first output carries its sampling
settings when its text depends on them. When a stop string matches, the request is finished
towards the frontend at once, and the scheduler is told to abort it; until the scheduler's
own finish for it arrives (its "abort", or a finish that crossed the abort on the way), its
outputs are dropped, so the frontend sees exactly one finish.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import OrderedDict

import zmq
from tokenizers import Tokenizer

from detokenizer_proc.decoders import TokenDecoder, decoder_for
from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.stop_strings import StopStringMatcher
from pegainfer import ipc
from pegainfer.process import child_args, init_child, report_ready
from pegainfer.protocol import (
    AbortRequests,
    ProtocolError,
    SamplingParams,
    SeqOutput,
    TextDelta,
    TextOutputs,
    TokenLogprobs,
    TokenOutputs,
    unpack_ids,
)

logger = logging.getLogger("detokenizer_proc")

NAME = "detokenizer"
ACCEPTED = (TokenOutputs,)
# Requests finished here by a stop string whose scheduler finish has not come back yet.
# Bounded only as a safety net: every one of them gets its finish within a step or two.
MAX_STOPPED_REMEMBERED = 65536
_DEFAULT_SAMPLING = SamplingParams()


class RequestText:
    """The text state of one request: incremental decoding, then stop strings."""

    __slots__ = ("detokenizer", "matcher", "min_tokens")

    def __init__(self, decoder: TokenDecoder, sampling: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(decoder, sampling.skip_special_tokens)
        self.matcher = (
            StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output)
            if sampling.stop
            else None
        )
        self.min_tokens = sampling.min_tokens

    def update(
        self, token_ids: list[int], num_output_tokens: int, finished: bool
    ) -> tuple[str, str | None]:
        """New text to emit, and the stop string that ended the request, if one did."""
        text = self.detokenizer.update(token_ids, finished=finished)
        if self.matcher is None:
            return text, None
        # Stop strings count only once min_tokens tokens exist.
        emitted, matched = self.matcher.feed(text, check=num_output_tokens >= self.min_tokens)
        if finished and matched is None:
            emitted += self.matcher.flush()
        return emitted, matched


class Detokenizer:
    """Text state of every unfinished request; pure logic, no sockets."""

    def __init__(self, tokenizer: Tokenizer | TokenDecoder) -> None:
        # A tokenizer is swapped for the lightest decoder that decodes exactly like it.
        self.decoder = decoder_for(tokenizer)
        self._states: dict[str, RequestText] = {}
        self._stopped: OrderedDict[str, None] = OrderedDict()
        self._aborts: list[str] = []

    @property
    def num_active(self) -> int:
        return len(self._states)

    @property
    def num_stopped(self) -> int:
        """Requests ended by a stop string whose scheduler finish is still due."""
        return len(self._stopped)

    def take_aborts(self) -> list[str]:
        """Requests the scheduler must stop (a stop string ended them); clears the list."""
        aborts, self._aborts = self._aborts, []
        return aborts

    def process(self, msg: TokenOutputs) -> TextOutputs:
        deltas = []
        for output in msg.outputs:
            delta = self._process_one(output)
            if delta is not None:
                deltas.append(delta)
        return TextOutputs(outputs=deltas)

    def _process_one(self, output: SeqOutput) -> TextDelta | None:
        request_id = output.request_id
        finished = output.finish_reason is not None
        if request_id in self._stopped:
            if finished:
                del self._stopped[request_id]
            return None
        try:
            token_ids = unpack_ids(output.new_token_ids)
        except ProtocolError as exc:
            logger.warning("request %s: dropped malformed token ids: %s", request_id, exc)
            token_ids = []
        # The tokenizer cannot take negative ids; nothing valid produces them.
        valid_ids = [token_id for token_id in token_ids if token_id >= 0]
        state = self._states.get(request_id)
        starts_in_reasoning = False
        if state is None:
            sampling = output.sampling or _DEFAULT_SAMPLING
            state = RequestText(self.decoder, sampling)
            self._states[request_id] = state
            starts_in_reasoning = sampling.starts_in_reasoning
        try:
            text, matched = state.update(valid_ids, output.completion_tokens, finished)
        except Exception:  # a tokenizer failure must cost this request's text, not the process
            logger.exception("request %s: could not decode tokens", request_id)
            text, matched = "", None
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if matched is not None:
            finish_reason, stop_reason = "stop", matched
            if not finished:
                self._remember_stopped(request_id)
                self._aborts.append(request_id)
            finished = True
        if finished:
            del self._states[request_id]
        return TextDelta(
            request_id=request_id,
            text=text,
            token_ids=output.new_token_ids if len(output.new_token_ids) % 4 == 0 else b"",
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            cached_tokens=output.cached_tokens,
            logprobs=self._with_bytes(output.logprobs),
            prompt_logprobs=self._with_bytes(output.prompt_logprobs),
            queue_time=output.queue_time,
            starts_in_reasoning=starts_in_reasoning,
        )

    def _remember_stopped(self, request_id: str) -> None:
        self._stopped[request_id] = None
        if len(self._stopped) > MAX_STOPPED_REMEMBERED:
            self._stopped.popitem(last=False)

    def _with_bytes(self, logprobs: TokenLogprobs | None) -> TokenLogprobs | None:
        if logprobs is None:
            return None
        try:
            ids = unpack_ids(logprobs.token_ids) + unpack_ids(logprobs.top_ids)
        except ProtocolError as exc:
            logger.warning("dropped malformed logprobs: %s", exc)
            return None
        logprobs.token_bytes = self.decoder.token_bytes(ids)
        return logprobs


def load_tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))


def load_decoder(model_path: str) -> TokenDecoder:
    """The model's decoder; the tokenizer it was built from is dropped when the byte table
    replaces it (report_ready then hands the freed heap back)."""
    return decoder_for(load_tokenizer(model_path))


def run(
    detokenizer: Detokenizer,
    inbound: zmq.Socket,
    frontend: zmq.Socket,
    scheduler: zmq.Socket | None = None,
) -> None:
    while True:
        msg = ipc.recv(inbound, ACCEPTED, NAME)
        if msg is None:
            continue  # malformed, already logged
        text = detokenizer.process(msg)
        if text.outputs:
            ipc.send(frontend, text)
        aborts = detokenizer.take_aborts()
        if aborts and scheduler is not None:
            ipc.send(scheduler, AbortRequests(request_ids=aborts))


def main() -> None:
    args = child_args("pegainfer detokenizer")
    config = init_child(NAME, args.run_dir)
    try:
        decoder = load_decoder(config.model_path)
    except Exception as exc:  # tokenizers raises its own exception type for a bad file
        logger.error("cannot load the tokenizer from %s: %s", config.model_path, exc)
        sys.exit(1)
    logger.info("decoding with %s", type(decoder).__name__)
    ctx = zmq.Context()
    inbound = ipc.bind(ctx, zmq.PULL, args.run_dir, NAME)
    frontend = ipc.connect(ctx, zmq.PUSH, args.run_dir, "frontend")
    scheduler = ipc.connect(ctx, zmq.PUSH, args.run_dir, "scheduler")
    report_ready(ctx, args.run_dir, NAME)
    run(Detokenizer(decoder), inbound, frontend, scheduler)
