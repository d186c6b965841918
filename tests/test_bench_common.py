"""The arithmetic the benchmarks print beside every figure: parameter and byte counts against
transformers' own models, rooflines, percentiles, tables; and the streaming safetensors writer
of tools/make_tiny_checkpoint.py."""

from __future__ import annotations

import json
import math
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tools.bench_client import (  # noqa: E402
    RequestResult,
    aggregate,
    clamp_vocab_range,
    random_token_prompts,
    uniform_lengths,
)
from tools.bench_common import (  # noqa: E402
    Roofline,
    decode_roofline_s,
    format_table,
    generation_roofline_s,
    load_model_shape,
    percentile,
    prefill_roofline_s,
    summarize,
)
from tools.make_tiny_checkpoint import build_config  # noqa: E402
from tools.safetensors_writer import write_safetensors  # noqa: E402


def _hf_param_count(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    # named_parameters yields a tied weight once.
    return sum(p.numel() for _, p in model.named_parameters())


@pytest.mark.parametrize("preset", ["tiny", "micro", "4b", "8b"])
def test_model_shape_counts_every_parameter(preset, tmp_path):
    config = build_config("qwen3", preset, "bfloat16")
    config.save_pretrained(tmp_path)
    shape = load_model_shape(str(tmp_path), dtype_bytes=2)
    assert shape.num_params == _hf_param_count(config)
    assert shape.tie_word_embeddings == config.tie_word_embeddings
    embed = config.vocab_size * config.hidden_size
    # A tied table is read in full as the LM head; an untied one only row by row.
    expected = shape.num_params - (0 if config.tie_word_embeddings else embed)
    assert shape.decode_weight_bytes == 2 * expected
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    assert shape.kv_bytes_per_token == kv


@pytest.mark.parametrize("preset", ["tiny", "30b-a3b"])
def test_mixture_of_experts_shape(preset, tmp_path):
    config = build_config("qwen3_moe", preset, "bfloat16")
    config.save_pretrained(tmp_path)
    shape = load_model_shape(str(tmp_path), dtype_bytes=2)
    assert shape.num_params == _hf_param_count(config)
    e, k = config.num_experts, config.num_experts_per_tok
    expert_bytes = 2 * 3 * config.hidden_size * config.moe_intermediate_size
    sparse = shape.num_sparse_layers
    assert sparse == (2 if preset == "tiny" else 48)
    everything = 2 * (shape.num_params - config.vocab_size * config.hidden_size)
    # One token reads k experts a sparse layer; many read them all.
    assert shape.step_weight_bytes(1) == pytest.approx(everything - sparse * (e - k) * expert_bytes)
    assert shape.step_weight_bytes(4096) == pytest.approx(everything)
    assert shape.experts_touched(2) == pytest.approx(e * (1 - (1 - k / e) ** 2))
    if preset == "30b-a3b":
        # Qwen3-30B-A3B: 30.5B parameters, 3.3B active a token.
        assert 30.4e9 < shape.num_params < 30.6e9
        active = shape.matmul_params_per_token + 2 * config.vocab_size * config.hidden_size
        assert 3.2e9 < active < 3.4e9


def test_qwen3_4b_decode_roofline_matches_the_design_anchor(tmp_path):
    # DESIGN.md: Qwen3-4B bf16 on an H200 has a measured copy roofline of ~531 tok/s; with
    # the H200's ~4.3 TB/s copy rate the weights alone (8.04 GB) give that figure.
    build_config("qwen3", "4b", "bfloat16").save_pretrained(tmp_path)
    shape = load_model_shape(str(tmp_path), dtype_bytes=2)
    assert 8.0e9 < shape.decode_weight_bytes < 8.1e9
    roof = Roofline("h200", "bfloat16", copy_bytes_per_s=4.3e12, matmul_flops_per_s=8e14)
    tok_s = 1.0 / decode_roofline_s(shape, roof, [128])
    assert 520 < tok_s < 540
    # At 4k context the KV cache (144 KiB per token) adds ~7% to the bytes.
    slower = 1.0 / decode_roofline_s(shape, roof, [4096])
    assert 0.9 < slower / tok_s < 0.95


def test_rooflines_take_the_binding_resource(tmp_path):
    build_config("qwen3", "4b", "bfloat16").save_pretrained(tmp_path)
    shape = load_model_shape(str(tmp_path), dtype_bytes=2)
    roof = Roofline("x", "bfloat16", copy_bytes_per_s=1e12, matmul_flops_per_s=1e14)
    # Decode of batch 1 is bandwidth-bound: exactly bytes / bandwidth.
    assert decode_roofline_s(shape, roof, [100]) == pytest.approx(
        shape.decode_step_bytes([100]) / 1e12
    )
    # A long prefill is compute-bound: at least 2 * params FLOPs per token.
    tokens = 4096
    prefill = prefill_roofline_s(shape, roof, [tokens])
    assert prefill >= 2 * shape.num_layers * shape.layer_matmul_params * tokens / 1e14
    assert prefill > shape.prefill_bytes([tokens]) / 1e12
    # A whole run is its prefill plus output - 1 decode steps.
    run = generation_roofline_s(shape, roof, 2, 64, 3)
    steps = [decode_roofline_s(shape, roof, [64 + i] * 2) for i in range(2)]
    assert run == pytest.approx(prefill_roofline_s(shape, roof, [64, 64]) + sum(steps))


def test_attention_flops_count_the_causal_pairs(tmp_path):
    build_config("qwen3", "tiny", "float32").save_pretrained(tmp_path)
    shape = load_model_shape(str(tmp_path))
    per_pair = 4 * shape.num_layers * shape.num_heads * shape.head_dim
    # A 3-token prefill attends 1 + 2 + 3 pairs; one decode token at context 10 attends 10.
    assert shape.attention_flops(3, 3) == per_pair * 6
    assert shape.attention_flops(1, 10) == per_pair * 10


def test_percentiles_and_summaries():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(list(range(101)), 90) == 90
    assert math.isnan(percentile([], 50))
    s = summarize([0.001, 0.003], scale=1e3)
    assert s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)


def test_table_aligns_and_formats():
    text = format_table("t", ["a", "roofline ms"], [[1, 2.345], [1000, float("nan")]])
    lines = text.splitlines()
    assert lines[0] == "t"
    assert lines[1].split() == ["a", "roofline", "ms"]
    assert lines[3].split() == ["1", "2.35"]
    assert lines[4].split() == ["1,000", "-"]
    assert len({len(line) for line in lines[1:]}) == 1


def test_prompts_and_lengths_are_reproducible_and_in_range(tmp_path):
    lens = uniform_lengths(200, 100, 0.5, seed=1)
    assert min(lens) >= 50 and max(lens) <= 150 and len(set(lens)) > 20
    assert uniform_lengths(5, 10, 0.0, seed=3) == [10] * 5
    prompts = random_token_prompts([3, 7], (10, 20), seed=2)
    assert [len(p) for p in prompts] == [3, 7]
    assert all(10 <= t < 20 for p in prompts for t in p)
    assert prompts == random_token_prompts([3, 7], (10, 20), seed=2)
    build_config("qwen3", "micro", "float32").save_pretrained(tmp_path)
    assert clamp_vocab_range((100, 10000), str(tmp_path)) == (100, 4096)
    assert clamp_vocab_range((100, 10000), None) == (100, 10000)


def test_aggregate_follows_the_serving_definitions():
    a = RequestResult(True, 10, output_tokens=5, start=0.0, ttft=0.1, latency=0.5)
    a.itl = [0.1, 0.1, 0.1, 0.1]
    b = RequestResult(True, 20, output_tokens=3, start=0.0, ttft=0.3, latency=0.5)
    b.itl = [0.1, 0.1]
    failed = RequestResult(False, 5, error="HTTP 500: boom")
    summary = aggregate([a, b, failed], duration=2.0)
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["errors"] == ["HTTP 500: boom"]
    assert summary["output_throughput"] == 4.0
    assert summary["total_token_throughput"] == 19.0
    assert summary["request_throughput"] == 1.0
    assert summary["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT excludes the first token: (0.5 - 0.1) / 4 and (0.5 - 0.3) / 2.
    assert summary["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(100.0)
    assert summary["mean_concurrency"] == pytest.approx(0.5)


def test_streaming_safetensors_writer_round_trips(tmp_path):
    from safetensors import safe_open

    tensors = {
        "a.weight": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),  # 14 bytes: the next offset is unaligned
        "c.bias": torch.arange(6, dtype=torch.float16).reshape(2, 3),
    }
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    path = str(tmp_path / "x.safetensors")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=3) as pool:
        written = write_safetensors(path, specs, lambda name: tensors[name], pool)
    assert written == sum(t.numel() * t.element_size() for t in tensors.values())
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    assert (8 + header_len) % 8 == 0
    assert header["__metadata__"] == {"format": "pt"}
    assert os.path.getsize(path) == 8 + header_len + written
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == set(tensors)
        for name, value in tensors.items():
            assert torch.equal(f.get_tensor(name), value)


def test_micro_preset_loads_in_transformers(tmp_path):
    from tools.make_tiny_checkpoint import make_checkpoint

    out = make_checkpoint(str(tmp_path), "qwen3", "micro", seed=0, dtype="float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.config.vocab_size == 4096
    assert model.config.eos_token_id is None and model.config.pad_token_id == 0
    ids = torch.arange(100, 120).unsqueeze(0)
    with torch.no_grad():
        out_ids = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out_ids.shape == (1, 28) and int(out_ids.max()) < 4096
