"""The tokenizer process: ``python -m frontend_proc.tokenizer_proc --run-dir DIR --index I``.

It pulls GenerateRequests that the frontend pushes round-robin, renders and tokenizes them,
and sends each on to the scheduler, or back to the frontend as a RequestRejected. It also
answers the frontend's /tokenize and /detokenize calls (the frontend loads no tokenizer).
"""

from __future__ import annotations

import logging
import os

import zmq
from tokenizers import Tokenizer

from frontend_proc.chat_template import ChatTemplate
from frontend_proc.errors import SERVER_ERROR, APIError
from frontend_proc.preprocess import Preprocessor, handle
from frontend_proc.tokenizer_calls import answer
from pegainfer import ipc
from pegainfer.config import EngineConfig
from pegainfer.process import child_args, init_child, report_ready
from pegainfer.protocol import DetokenizeRequest, GenerateRequest, RequestRejected, TokenizeRequest

logger = logging.getLogger(__name__)

ACCEPTED = (GenerateRequest, TokenizeRequest, DetokenizeRequest)


def load_preprocessor(config: EngineConfig) -> Preprocessor:
    tokenizer = Tokenizer.from_file(os.path.join(config.model_path, "tokenizer.json"))
    template = ChatTemplate.load(config.model_path, config.chat_template)
    vocab_size = (
        config.model.vocab_size
        if config.model is not None
        else tokenizer.get_vocab_size(with_added_tokens=True)
    )
    max_model_len = config.max_model_len
    if max_model_len <= 0 and config.model is not None:
        max_model_len = config.model.longest_context()
    return Preprocessor(tokenizer, template, max_model_len, vocab_size, config.reasoning_parser)


def main() -> None:
    args = child_args("pegainfer tokenizer process")
    name = f"tokenizer-{args.index}"
    config = init_child(name, args.run_dir)
    config.run_dir = args.run_dir
    ctx = zmq.Context()
    requests = ipc.connect(ctx, zmq.PULL, args.run_dir, "tokenizer")
    to_scheduler = ipc.connect(ctx, zmq.PUSH, args.run_dir, "scheduler")
    to_frontend = ipc.connect(ctx, zmq.PUSH, args.run_dir, "frontend")
    preprocessor = load_preprocessor(config)
    # The launcher passes "reasoning" on to the frontend, which has no tokenizer to tell.
    reasoning = preprocessor.reasoning
    report_ready(ctx, args.run_dir, name, vocab_size=preprocessor.vocab_size, reasoning=reasoning)
    logger.info("ready: max_model_len=%d", preprocessor.max_model_len)
    while True:
        request = ipc.recv(requests, ACCEPTED, name)
        if request is None:
            continue
        if isinstance(request, GenerateRequest):
            outcome = handle(preprocessor, request)
            forward_to_scheduler = not isinstance(outcome, RequestRejected)
        else:  # a /tokenize or /detokenize call: the answer goes back to the frontend
            outcome = answer(preprocessor, request)
            forward_to_scheduler = False
        try:
            if isinstance(outcome, RequestRejected):
                logger.debug("rejected %s: %s", request.request_id, outcome.message)
            ipc.send(to_scheduler if forward_to_scheduler else to_frontend, outcome)
        except Exception:  # noqa: BLE001 - an unsendable request must not stop the process
            logger.exception("could not forward request %s", request.request_id)
            error = APIError(500, "internal error while forwarding the request", SERVER_ERROR)
            ipc.send(to_frontend, error.to_rejection(request.request_id))


if __name__ == "__main__":
    main()
