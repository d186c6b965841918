"""Token-id prompts with a known vocabulary skip the tokenizer: the frontend checks them as a
tokenizer process would and sends a TokenizedRequest straight to the scheduler. Text and
chat still go to a tokenizer, and so do id prompts when the vocabulary is unknown."""

from __future__ import annotations

import asyncio

from aiohttp.test_utils import TestClient, TestServer

from frontend_proc.app import create_app
from pegainfer.config import EngineConfig, ModelInfo
from pegainfer.protocol import GenerateRequest, TextDelta, TokenizedRequest, pack_ids

MODEL = "tiny-model"
VOCAB = 100
MAX_MODEL_LEN = 64


class RecordingEngine:
    def __init__(self) -> None:
        self.requests: list[GenerateRequest | TokenizedRequest] = []

    async def generate(self, request):
        self.requests.append(request)
        await asyncio.sleep(0)
        yield TextDelta(
            request_id=request.request_id,
            text="ok",
            token_ids=pack_ids([7]),
            finish_reason="length",
            stop_reason=None,
            prompt_tokens=3,
            completion_tokens=1,
            cached_tokens=0,
        )

    def abort(self, request_ids: list[str]) -> None:
        pass


def config(with_vocab: bool = True) -> EngineConfig:
    model = ModelInfo(
        architecture="Qwen3ForCausalLM",
        vocab_size=VOCAB,
        max_position_embeddings=MAX_MODEL_LEN,
        eos_token_ids=[2],
        bos_token_id=None,
        num_hidden_layers=1,
        num_kv_heads=1,
        head_dim=8,
        hidden_size=8,
    )
    return EngineConfig(
        model_path="/models/tiny",
        served_model_name=MODEL,
        max_model_len=MAX_MODEL_LEN,
        model=model if with_vocab else None,
    )


def post(body: dict, with_vocab: bool = True) -> tuple[int, dict, RecordingEngine]:
    engine = RecordingEngine()

    async def main() -> tuple[int, dict]:
        async with TestClient(TestServer(create_app(config(with_vocab), engine))) as client:
            response = await client.post("/v1/completions", json={"model": MODEL, **body})
            return response.status, await response.json()

    status, payload = asyncio.run(main())
    return status, payload, engine


def test_id_prompt_goes_to_the_scheduler_checked_and_resolved() -> None:
    status, payload, engine = post({"prompt": [5, 6, 7], "max_tokens": 4, "seed": 3, "n": 2})
    assert status == 200, payload
    assert len(engine.requests) == 2
    for request in engine.requests:
        assert isinstance(request, TokenizedRequest)
        assert request.prompt_token_ids == pack_ids([5, 6, 7])
        assert request.sampling.max_tokens == 4
    # n choices of one seeded prompt get distinct seeds, as through the tokenizer.
    assert engine.requests[0].sampling.seed != engine.requests[1].sampling.seed


def test_id_prompt_without_max_tokens_gets_the_completion_default() -> None:
    status, _, engine = post({"prompt": [[5], [6, 7]]})
    assert status == 200
    assert [r.prompt_token_ids for r in engine.requests] == [pack_ids([5]), pack_ids([6, 7])]
    assert all(isinstance(r, TokenizedRequest) for r in engine.requests)


def test_id_prompt_errors_are_the_tokenizers_400s() -> None:
    cases = [
        ({"prompt": [5, VOCAB]}, "prompt", None),
        ({"prompt": [5, 6], "stop_token_ids": [VOCAB + 3]}, "stop_token_ids", None),
        ({"prompt": [5] * 60, "max_tokens": 10}, "max_tokens", "context_length_exceeded"),
        ({"prompt": [5] * 70, "max_tokens": 1}, "prompt", "context_length_exceeded"),
    ]
    for body, param, code in cases:
        status, payload, engine = post(body)
        assert status == 400, (body, payload)
        assert payload["error"]["param"] == param, payload
        assert payload["error"]["code"] == code, payload
        assert engine.requests == [], "a refused prompt reaches no process"


def test_text_and_unknown_vocabulary_still_go_to_a_tokenizer() -> None:
    _, _, engine = post({"prompt": "hello", "max_tokens": 2})
    assert [type(r) for r in engine.requests] == [GenerateRequest]
    _, _, engine = post({"prompt": [5, 6], "max_tokens": 2}, with_vocab=False)
    assert [type(r) for r in engine.requests] == [GenerateRequest]
    assert engine.requests[0].prompt_token_ids == pack_ids([5, 6])
