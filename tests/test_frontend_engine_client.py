"""EngineClient over real ZeroMQ sockets in one process: requests go out to the tokenizers,
deltas and rejections come back to the right request, garbage is dropped, aborts reach the
scheduler, and no per-request state is left behind."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from frontend_proc.engine_client import EngineClient
from frontend_proc.errors import APIError
from pegainfer import ipc, protocol
from pegainfer.protocol import (
    AbortRequests,
    DetokenizeRequest,
    DetokenizeResult,
    GenerateRequest,
    RequestRejected,
    SamplingParams,
    TextDelta,
    TextOutputs,
    TokenizeRequest,
    TokenizeResult,
    pack_ids,
)


def generate_request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, "hi", None, None, {}, False, SamplingParams(), 1.0)


def text_delta(request_id: str, text: str, finish: str | None = None) -> TextDelta:
    return TextDelta(request_id, text, b"", finish, None, 2, 1, 0)


async def recv(sock: zmq.asyncio.Socket, expected: tuple[type, ...]):
    data = await asyncio.wait_for(sock.recv(), timeout=5)
    return protocol.decode(data, expected)


def test_engine_client_round_trip(tmp_path):
    run_dir = str(tmp_path)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        engine = EngineClient(run_dir)
        engine.start()
        tokenizer = ipc.connect(ctx, zmq.PULL, run_dir, "tokenizer")
        scheduler = ipc.bind(ctx, zmq.PULL, run_dir, "scheduler")
        detokenizer = ipc.connect(ctx, zmq.PUSH, run_dir, "frontend")
        try:

            async def consume(request_id: str) -> list[str]:
                return [d.text async for d in engine.generate(generate_request(request_id))]

            first = asyncio.ensure_future(consume("a"))
            second = asyncio.ensure_future(consume("b"))
            got = {(await recv(tokenizer, (GenerateRequest,))).request_id for _ in range(2)}
            assert got == {"a", "b"} and engine.num_active == 2

            await detokenizer.send(b"\x01\x02 not msgpack")  # dropped, not fatal
            outputs = TextOutputs(
                [text_delta("a", "x"), text_delta("zzz", "?"), text_delta("b", "1")]
            )
            await detokenizer.send(protocol.encode(outputs))
            await detokenizer.send(protocol.encode(TextOutputs([text_delta("a", "y", "stop")])))
            rejected = RequestRejected("b", 400, "too long", "invalid_request_error", None, None)
            await detokenizer.send(protocol.encode(rejected))

            assert await asyncio.wait_for(first, 5) == ["x", "y"]
            with pytest.raises(APIError) as info:
                await asyncio.wait_for(second, 5)
            assert (info.value.status, info.value.message) == (400, "too long")
            assert engine.num_active == 0

            assert engine.metrics.finished == {"stop": 1}  # a rejection is no finish

            # A consumer cancelled mid-request leaves no queue behind, and counts as aborted.
            third = asyncio.ensure_future(consume("c"))
            await recv(tokenizer, (GenerateRequest,))
            assert engine.num_active == 1
            third.cancel()
            with pytest.raises(asyncio.CancelledError):
                await third
            assert engine.num_active == 0
            assert engine.metrics.finished == {"stop": 1, "abort": 1}

            # One that leaves right after its last delta counts as finished by it.
            stream = engine.generate(generate_request("e"))
            reading = asyncio.ensure_future(anext(stream))
            await recv(tokenizer, (GenerateRequest,))
            await detokenizer.send(protocol.encode(TextOutputs([text_delta("e", "z", "length")])))
            assert (await asyncio.wait_for(reading, 5)).finish_reason == "length"
            await stream.aclose()
            assert engine.metrics.finished == {"stop": 1, "abort": 1, "length": 1}
            # And one closed mid-stream, after a delta, counts as aborted.
            stream = engine.generate(generate_request("f"))
            reading = asyncio.ensure_future(anext(stream))
            await recv(tokenizer, (GenerateRequest,))
            await detokenizer.send(protocol.encode(TextOutputs([text_delta("f", "w")])))
            assert (await asyncio.wait_for(reading, 5)).text == "w"
            await stream.aclose()
            assert engine.metrics.finished == {"stop": 1, "abort": 2, "length": 1}
            assert engine.num_active == 0

            engine.abort(["c", "d"])
            engine.abort([])  # sends nothing
            abort = await recv(scheduler, (AbortRequests,))
            assert abort.request_ids == ["c", "d"]
            assert not await scheduler.poll(100)
        finally:
            await engine.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_tokenizer_calls_get_their_own_answer(tmp_path):
    run_dir = str(tmp_path)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        engine = EngineClient(run_dir)
        engine.start()
        tokenizer = ipc.connect(ctx, zmq.PULL, run_dir, "tokenizer")
        answers = ipc.connect(ctx, zmq.PUSH, run_dir, "frontend")
        calls = (TokenizeRequest, DetokenizeRequest)
        try:
            request = TokenizeRequest("tok-1", "hi", None, {}, True, True, True)
            tokenized = asyncio.ensure_future(engine.tokenize(request))
            detokenized = asyncio.ensure_future(
                engine.detokenize(DetokenizeRequest("detok-1", pack_ids([1])))
            )
            rejected = asyncio.ensure_future(
                engine.detokenize(DetokenizeRequest("detok-2", pack_ids([10**6])))
            )
            got = {(await recv(tokenizer, calls)).request_id for _ in range(3)}
            assert got == {"tok-1", "detok-1", "detok-2"}
            assert engine.num_active == 0  # calls are not requests in flight (drain, metrics)
            refusal = RequestRejected("detok-2", 400, "out of vocabulary", "x", "tokens", None)
            for msg in (
                DetokenizeResult("detok-1", "hello"),
                refusal,
                TokenizeResult("unknown", pack_ids([1]), None),  # nobody waits: dropped
                TokenizeResult("tok-1", pack_ids([7, 8]), ["hi", "!"]),
            ):
                await answers.send(protocol.encode(msg))
            assert (await asyncio.wait_for(tokenized, 5)).token_strs == ["hi", "!"]
            assert (await asyncio.wait_for(detokenized, 5)).text == "hello"
            with pytest.raises(APIError) as info:
                await asyncio.wait_for(rejected, 5)
            assert (info.value.status, info.value.param) == (400, "tokens")

            # A body msgpack cannot carry is the client's mistake, not the server's.
            huge = {"x": 2**64}
            with pytest.raises(APIError) as info:
                await engine.tokenize(TokenizeRequest("tok-2", None, [], huge, True, False, False))
            assert info.value.status == 400

            # A call waiting when the engine dies fails at once, and so does every later one.
            pending = asyncio.ensure_future(
                engine.detokenize(DetokenizeRequest("detok-3", pack_ids([1])))
            )
            await recv(tokenizer, calls)
            engine.fail_all("tokenizer-0 was killed")
            with pytest.raises(APIError) as info:
                await asyncio.wait_for(pending, 5)
            assert info.value.status == 503
            with pytest.raises(APIError):
                await engine.tokenize(TokenizeRequest("tok-3", "hi", None, {}, True, True, False))
        finally:
            await engine.close()
            ctx.destroy(linger=0)

    asyncio.run(main())
