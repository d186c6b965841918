"""tools/prefill_profile.py: the kernels of prefill-only steps grouped into the parts of a step
beside their FLOP or byte floors; the profiled window of tools/bench_inprocess.profile_prefill
(on the CPU, and on CUDA against a real prefill)."""

from __future__ import annotations

import argparse

import pytest
import torch
from test_step_profile import SHAPE

from tools.bench_model import Roofline
from tools.prefill_profile import prefill_floors_us
from tools.step_profile import LM_HEAD, Kernel, breakdown, format_breakdown

ROOF = Roofline("test", "bfloat16", copy_bytes_per_s=1e12, matmul_flops_per_s=1e14)


def test_projection_floors_take_the_larger_of_flops_and_bytes():
    floors = prefill_floors_us(SHAPE, ROOF, [1000], steps=1)
    # gate/up at 1,000 tokens: 2 * 1000 * 64 * 256 * 2 layers FLOPs against
    # (64 * 256 + 1000 * 320) * 2 bytes * 2 layers.
    flops_us = 2 * 1000 * 64 * 256 * 2 / 1e14 * 1e6
    bytes_us = (64 * 256 + 1000 * (64 + 256)) * 2 * 2 / 1e12 * 1e6
    assert floors["gate_up"] == pytest.approx(max(flops_us, bytes_us))
    # The LM head reads its weight for a few last tokens.
    assert floors[LM_HEAD] == pytest.approx(64 * 1000 * 2 / 1e12 * 1e6)
    # Over two steps each step has half the FLOPs, but reads the weights again.
    halved = prefill_floors_us(SHAPE, ROOF, [1000], steps=2)
    bytes_us = (64 * 256 + 500 * (64 + 256)) * 2 * 2 / 1e12 * 1e6
    assert halved["gate_up"] == pytest.approx(max(flops_us / 2, bytes_us))
    assert halved["prefill attention"] == pytest.approx(floors["prefill attention"] / 2)
    assert halved[LM_HEAD] == pytest.approx(floors[LM_HEAD])


def test_attention_floor_counts_the_causal_pairs():
    short = prefill_floors_us(SHAPE, ROOF, [100], 1)["prefill attention"]
    long = prefill_floors_us(SHAPE, ROOF, [200], 1)["prefill attention"]
    # n (n + 1) / 2 pairs: 5,050 against 20,100.
    assert long / short == pytest.approx(20100 / 5050)
    pairs = 100 * 101 / 2
    assert short == pytest.approx(4 * 2 * 4 * 16 * pairs / 1e14 * 1e6)
    # Two prompts of 100 are two causal blocks, not one of 200.
    two = prefill_floors_us(SHAPE, ROOF, [100, 100], 1)["prefill attention"]
    assert two == pytest.approx(2 * short)


def test_prefill_steps_are_grouped_with_their_floors():
    # A layer as an eager prefill launches it: cuBLAS projections, Triton elsewhere.
    layer = [
        ("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 40.0),
        ("_rotary_kernel", 3.0),
        ("_work_table_kernel", 1.0),
        ("_prefill_kernel", 20.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", 15.0),
        ("_rms_norm_kernel", 4.0),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 90.0),
        ("_silu_and_mul_kernel", 6.0),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_TNT", 45.0),
        ("_rms_norm_kernel", 4.0),
    ]
    tail = [("_skinny_gemm_kernel", 60.0), ("_argmax_kernel", 3.0)]
    kernels, clock = [], 0.0
    for _ in range(3):
        for name, duration in layer * SHAPE.num_layers + tail:
            kernels.append(Kernel(name, clock, duration))
            clock += duration + 1.0
    floors = prefill_floors_us(SHAPE, ROOF, [1000] * 3, steps=3)
    result = breakdown(kernels, 3, SHAPE, floors=floors)
    parts = {p["part"]: p for p in result["parts"]}
    assert parts["gate_up"]["us_per_step"] == pytest.approx(2 * 90.0)
    assert parts["prefill attention"]["us_per_step"] == pytest.approx(2 * 21.0)
    assert parts["silu x mul"]["floor_us_per_step"] == pytest.approx(floors["silu x mul"])
    assert parts[LM_HEAD]["kernels_per_step"] == 1
    assert result["floor_us"] == pytest.approx(sum(floors.values()))
    text = format_breakdown("prefill", result, SHAPE.num_layers)
    assert "prefill attention" in text and "gate_up" in text


def _profiled_prefill(tmp_path, device: str, prompts: int, length: int, budget: int):
    from tools.bench_inprocess import make_inprocess_runner, profile_prefill
    from tools.bench_model import load_model_shape
    from tools.make_tiny_checkpoint import make_checkpoint

    path = make_checkpoint(str(tmp_path / "tiny"), arch="qwen3", preset="tiny", seed=0)
    shape = load_model_shape(path)
    args = argparse.Namespace(
        model_path=path,
        device=device,
        dtype="bfloat16" if device == "cuda" else "float32",
        input_len=length,
        output_len=4,
        max_num_batched_tokens=budget,
        enforce_eager=False,
        seed=0,
    )
    runner, config = make_inprocess_runner(args, prompts, shape)
    batch = [[100 + i + j for j in range(length)] for i in range(prompts)]
    prof, steps = profile_prefill(runner, config, batch)
    return runner, shape, prof, steps, batch


def test_every_step_of_the_window_is_a_prefill(tmp_path):
    # 4 prompts of 40 at 48 tokens a step: 4 steps, each request done at its first token.
    runner, _, prof, steps, _ = _profiled_prefill(tmp_path, "cpu", 4, 40, 48)
    assert steps == 4
    assert any(e.name == "aten::rsqrt" for e in prof.events()), "no model forward profiled"
    assert not runner.has_pending() and not runner.live.seqs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: kernels of a prefill")
def test_profiled_prefill_on_cuda_names_every_part(tmp_path):
    from tools.bench_common import measure_roofline
    from tools.prefill_profile import summarize_prefill

    runner, shape, prof, steps, batch = _profiled_prefill(tmp_path, "cuda", 4, 512, 1024)
    assert steps == 2
    roof = measure_roofline(runner.device, runner.dtype)
    result, table = summarize_prefill(prof, steps, shape, roof, [len(p) for p in batch], "tiny")
    parts = {p["part"]: p for p in result["parts"]}
    for name in ("qkv", "o", "gate_up", "down", LM_HEAD, "prefill attention"):
        assert parts[name]["us_per_step"] > 0, table
        assert parts[name]["floor_us_per_step"] > 0, table
    assert parts["qkv"]["kernels_per_step"] >= shape.num_layers
