"""The detokenizer process: `python -m detokenizer_proc --run-dir DIR`.

Turns each step's new token ids (one TokenOutputs from the scheduler) into one TextOutputs
for the frontend. Per-request state is created on first sight of a request id and dropped
when the request finishes.
"""

from __future__ import annotations

import logging
import os
import sys

import zmq
from tokenizers import Tokenizer

from detokenizer_proc.incremental import IncrementalDetokenizer
from pegainfer import ipc
from pegainfer.process import child_args, init_child, report_ready
from pegainfer.protocol import (
    ProtocolError,
    SeqOutput,
    TextDelta,
    TextOutputs,
    TokenOutputs,
    unpack_ids,
)

logger = logging.getLogger("detokenizer_proc")

NAME = "detokenizer"
ACCEPTED = (TokenOutputs,)


class Detokenizer:
    """Text state of every unfinished request; pure logic, no sockets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, IncrementalDetokenizer] = {}

    @property
    def num_active(self) -> int:
        return len(self._states)

    def process(self, msg: TokenOutputs) -> TextOutputs:
        return TextOutputs(outputs=[self._process_one(output) for output in msg.outputs])

    def _process_one(self, output: SeqOutput) -> TextDelta:
        finished = output.finish_reason is not None
        try:
            token_ids = unpack_ids(output.new_token_ids)
        except ProtocolError as exc:
            logger.warning("request %s: dropped malformed token ids: %s", output.request_id, exc)
            token_ids = []
        # The tokenizer cannot take negative ids; nothing valid produces them.
        valid_ids = [token_id for token_id in token_ids if token_id >= 0]
        state = self._states.get(output.request_id)
        if state is None:
            state = IncrementalDetokenizer(self.tokenizer)
            self._states[output.request_id] = state
        try:
            text = state.update(valid_ids, finished=finished)
        except Exception:  # a tokenizer failure must cost this request's text, not the process
            logger.exception("request %s: could not decode tokens", output.request_id)
            text = ""
        if finished:
            del self._states[output.request_id]
        return TextDelta(
            request_id=output.request_id,
            text=text,
            token_ids=output.new_token_ids if len(output.new_token_ids) % 4 == 0 else b"",
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            cached_tokens=output.cached_tokens,
        )


def load_tokenizer(model_path: str) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(model_path, "tokenizer.json"))


def run(detokenizer: Detokenizer, inbound: zmq.Socket, frontend: zmq.Socket) -> None:
    while True:
        msg = ipc.recv(inbound, ACCEPTED, NAME)
        if msg is None:
            continue  # malformed, already logged
        ipc.send(frontend, detokenizer.process(msg))


def main() -> None:
    args = child_args("pegainfer detokenizer")
    config = init_child(NAME, args.run_dir)
    try:
        tokenizer = load_tokenizer(config.model_path)
    except Exception as exc:  # tokenizers raises its own exception type for a bad file
        logger.error("cannot load the tokenizer from %s: %s", config.model_path, exc)
        sys.exit(1)
    ctx = zmq.Context()
    inbound = ipc.bind(ctx, zmq.PULL, args.run_dir, NAME)
    frontend = ipc.connect(ctx, zmq.PUSH, args.run_dir, "frontend")
    report_ready(ctx, args.run_dir, NAME)
    run(Detokenizer(tokenizer), inbound, frontend)
