"""tools/step_profile.py: kernels of a decode step grouped into its parts, the projections named
by their place in the step, and each part's floor; on CUDA, against a real profiled decode."""

from __future__ import annotations

import dataclasses

import pytest

from tools.bench_model import ModelShape, Roofline
from tools.step_profile import (
    EXPERTS,
    FUSED_ROUTER,
    GEMM,
    LM_HEAD,
    OTHER,
    Kernel,
    breakdown,
    format_breakdown,
    kernel_part,
    label_kernels,
    part_floors_us,
)

SHAPE = ModelShape(
    architecture="Qwen3ForCausalLM",
    num_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=1000,
    tie_word_embeddings=True,
    has_qk_norm=True,
    dtype_bytes=2,
)
ROOF = Roofline("test", "bfloat16", copy_bytes_per_s=1e12, matmul_flops_per_s=1e15)

# One layer as the model launches it: norm, qkv (split-K: a GEMM and its reduction), rotary,
# attention, o, norm, gate_up, SiLU-and-mul, down.
LAYER = [
    ("triton_rms_norm_kernel_0d1d", 2.0),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", 5.0),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", 1.0),
    ("_rotary_kernel", 3.0),
    ("_decode_split_kernel", 7.0),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", 4.0),
    ("_rms_norm_kernel", 2.0),
    ("_gemv_kernel", 20.0),
    ("_silu_and_mul_kernel", 2.0),
    ("_gemv_kernel", 10.0),
]
TAIL = [
    ("_rms_norm_kernel", 2.0),
    ("nvjet_tst_lm_head", 50.0),
    ("void at::native::reduce_kernel<512, 1, argmax>", 3.0),
    ("Memcpy DtoD (Device -> Device)", 1.0),
]


def step_kernels(steps: int, gap_us: float = 0.5, layers: int = 2) -> list[Kernel]:
    kernels, clock = [], 100.0
    for _ in range(steps):
        for name, duration in LAYER * layers + TAIL:
            kernels.append(Kernel(name, clock, duration))
            clock += duration + gap_us
    return kernels


def test_kernel_names_map_to_parts():
    assert kernel_part("nvjet_tst_128x8_64x8_2x1_v_bz_TNN") == GEMM
    assert kernel_part("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16>") == GEMM
    assert kernel_part("gemv2T_kernel_val<int, int, __nv_bfloat16>") == GEMM
    assert kernel_part("_skinny_gemm_kernel") == GEMM
    assert kernel_part("_decode_split_kernel") == "decode attention"
    assert kernel_part("_prefill_kernel") == "prefill attention"
    assert kernel_part("_rotary_kernel") == "q/k norm + rotary + kv write"
    assert kernel_part("Memset (Device)") == "copies and memsets"
    assert kernel_part("void at::native::vectorized_elementwise_kernel<4>") == OTHER
    # Every kernel of the sparse MLP, whichever path ran it (kernels/sparse_mlp.py).
    import kernels.moe_grouping
    import kernels.moe_route_group
    import kernels.moe_router_route
    import kernels.moe_routing
    import kernels.moe_sum

    moe_kernels = [
        name
        for module in (
            kernels.moe_grouping,
            kernels.moe_route_group,
            kernels.moe_router_route,
            kernels.moe_routing,
            kernels.moe_sum,
        )
        for name in vars(module)
        if name.startswith("_") and name.endswith("_kernel")
    ]
    assert len(moe_kernels) >= 8
    for name in moe_kernels:
        assert kernel_part(name).startswith("moe "), name
    assert kernel_part("_grouped_gemm_kernel") == EXPERTS


def test_gemm_runs_are_named_by_their_place_in_the_step():
    kernels = step_kernels(steps=3)
    parts = label_kernels(kernels, SHAPE.num_layers)
    gemms = [p for k, p in zip(kernels, parts) if kernel_part(k.name) == GEMM]
    # qkv is a GEMM and its split-K reduction: one run, both kernels named qkv.
    one_step = ["qkv", "qkv", "o", "gate_up", "down"] * 2 + [LM_HEAD]
    assert gemms == one_step * 3
    assert GEMM not in parts


def test_the_fused_gate_up_gemv_ends_its_projection():
    # One row: gate_up's GEMV ends in silu-and-mul, and down's GEMV follows it directly.
    layer = [
        ("_rms_norm_kernel", 2.0),
        ("_gemv_kernel", 8.0),
        ("_rotary_kernel", 2.0),
        ("_decode_split_kernel", 5.0),
        ("_gemv_kernel", 7.0),
        ("_rms_norm_kernel", 2.0),
        ("_gemv_silu_and_mul_kernel", 25.0),
        ("_gemv_kernel", 14.0),
    ]
    kernels, clock = [], 0.0
    for name, duration in layer * 2 + [("_rms_norm_kernel", 2.0), ("_gemv_kernel", 40.0)]:
        kernels.append(Kernel(name, clock, duration))
        clock += duration + 0.5
    parts = label_kernels(kernels, SHAPE.num_layers)
    gemms = [p for k, p in zip(kernels, parts) if kernel_part(k.name) == GEMM]
    assert gemms == ["qkv", "o", "gate_up", "down"] * 2 + [LM_HEAD]


def test_adjacent_projections_are_told_apart():
    # One row with the norm left pending: o ends in the residual add and gate/up reads the
    # pending norm, down ends in it and the next layer's qkv reads it, so no kernel
    # separates those projections.
    layer = [
        ("_gemv_kernel", 8.0),
        ("_rotary_kernel", 2.0),
        ("_decode_split_kernel", 5.0),
        ("_gemv_add_residual_kernel", 7.0),
        ("_gemv_silu_and_mul_kernel", 25.0),
        ("_skinny_gemm_kernel", 14.0),
    ]
    kernels, clock = [], 0.0
    for name, duration in layer * 2 + [("_gemv_kernel", 40.0)]:
        kernels.append(Kernel(name, clock, duration))
        clock += duration + 0.5
    parts = label_kernels(kernels, SHAPE.num_layers)
    gemms = [p for k, p in zip(kernels, parts) if kernel_part(k.name) == GEMM]
    assert gemms == ["qkv", "o", "gate_up", "down"] * 2 + [LM_HEAD]


def moe_shape() -> ModelShape:
    return dataclasses.replace(
        SHAPE,
        architecture="Qwen3MoeForCausalLM",
        intermediate_size=0,
        num_experts=8,
        experts_per_token=2,
        expert_intermediate_size=32,
        num_sparse_layers=SHAPE.num_layers,
    )


@pytest.mark.parametrize("fused_router", [False, True])
def test_sparse_layers_name_their_projections_and_the_router(fused_router):
    # A sparse layer at decode rows: qkv, o, then the router's GEMV and the routing kernel,
    # or the router ending in the routing (kernels/moe_router_route.py), then the experts.
    router = (
        [("_router_route_kernel", 4.0)]
        if fused_router
        else [("_gemv_kernel", 2.0), ("_route_pairs_kernel", 2.5)]
    )
    layer = [
        ("_gemv_kernel", 8.0),
        ("_rotary_kernel", 1.0),
        ("_decode_split_kernel", 6.0),
        ("_gemv_kernel", 6.0),
        *router,
        ("_grouped_gemm_kernel", 20.0),
        ("_grouped_gemm_kernel", 10.0),
        ("_sum_add_square_kernel", 1.0),
    ]
    kernels, clock = [], 0.0
    for _ in range(3):
        for name, duration in layer * 2 + [("_gemv_kernel", 40.0)]:
            kernels.append(Kernel(name, clock, duration))
            clock += duration + 0.5
    shape = moe_shape()
    result = breakdown(kernels, 3, shape, ROOF, [100])
    parts = {p["part"]: p for p in result["parts"]}
    assert parts["qkv"]["us_per_step"] == pytest.approx(16.0)
    assert parts["o"]["us_per_step"] == pytest.approx(12.0)
    assert parts[LM_HEAD]["us_per_step"] == pytest.approx(40.0)
    assert parts[EXPERTS]["us_per_step"] == pytest.approx(60.0)
    router_floor = part_floors_us(shape, ROOF, [100])["router"]
    if fused_router:
        assert "router" not in parts
        assert parts[FUSED_ROUTER]["us_per_step"] == pytest.approx(8.0)
        assert parts[FUSED_ROUTER]["floor_us_per_step"] == pytest.approx(router_floor)
    else:
        assert FUSED_ROUTER not in parts
        assert parts["router"]["us_per_step"] == pytest.approx(4.0)
        assert parts["router"]["floor_us_per_step"] == pytest.approx(router_floor)


def test_runs_that_do_not_fit_the_step_stay_unnamed():
    # Two layers' kernels profiled as if the model had three: no place can be trusted.
    kernels = step_kernels(steps=2)
    parts = label_kernels(kernels, num_layers=3)
    assert GEMM in parts and "qkv" not in parts and LM_HEAD not in parts


def test_breakdown_sums_parts_and_idle_per_step():
    steps, gap = 4, 0.5
    kernels = step_kernels(steps, gap_us=gap)
    result = breakdown(kernels, steps, SHAPE, ROOF, [100, 200])
    parts = {p["part"]: p for p in result["parts"]}
    assert parts["qkv"]["us_per_step"] == pytest.approx(2 * 6.0)
    assert parts["qkv"]["kernels_per_step"] == pytest.approx(4)
    assert parts["gate_up"]["us_per_step"] == pytest.approx(40.0)
    assert parts[LM_HEAD]["us_per_step"] == pytest.approx(50.0)
    assert parts["decode attention"]["us_per_step"] == pytest.approx(14.0)
    busy = sum(d for _, d in LAYER * 2 + TAIL)
    assert result["busy_us"] == pytest.approx(busy)
    launches = len(LAYER * 2 + TAIL)
    # Every kernel but the window's last is followed by a gap.
    assert result["idle_us"] == pytest.approx(gap * (launches * steps - 1) / steps)
    assert result["step_us"] == pytest.approx(result["busy_us"] + result["idle_us"])
    assert sum(p["share_of_step"] for p in result["parts"]) == pytest.approx(
        100 * busy / result["step_us"]
    )
    # Floors: weights of each projection, the LM head, and the KV of both contexts.
    floors = part_floors_us(SHAPE, ROOF, [100, 200])
    assert floors["o"] == pytest.approx(2 * 64 * 64 * 2 / 1e6)
    assert floors["decode attention"] == pytest.approx(302 * SHAPE.kv_bytes_per_token / 1e6)
    assert parts["o"]["floor_us_per_step"] == pytest.approx(floors["o"])
    assert result["floor_us"] == pytest.approx(sum(floors.values()))
    table = format_breakdown("title", result, SHAPE.num_layers)
    assert "idle between kernels" in table and "gate_up" in table and "floor us" in table


def test_long_gaps_are_told_apart_from_launch_gaps():
    # Two steps, 0.5 us between kernels, and the second step launched 40 us late.
    kernels = step_kernels(steps=2, gap_us=0.5)
    per_step = len(LAYER * 2 + TAIL)
    late = [Kernel(k.name, k.start_us + 40.0, k.duration_us) for k in kernels[per_step:]]
    result = breakdown(kernels[:per_step] + late, 2, SHAPE, ROOF)
    assert result["longest_gap_us"] == pytest.approx(40.5)
    assert result["long_gaps_us"] == pytest.approx(40.5 / 2)
    assert result["idle_us"] == pytest.approx((0.5 * (2 * per_step - 1) + 40.0) / 2)
    assert "gaps of 5 us or more" in format_breakdown("t", result, SHAPE.num_layers)


def test_overlapping_kernels_are_charged_from_the_end_of_the_one_before():
    # With programmatic dependent launch a kernel starts 2 us before the one before ends and
    # waits for it: the parts and the idle still tile the step, the overlap is shown apart.
    kernels = step_kernels(steps=1, gap_us=0.5)
    overlapped = [kernels[0]] + [
        Kernel(k.name, k.start_us - 2.5, k.duration_us + 2.5) for k in kernels[1:]
    ]
    plain = breakdown(kernels, 1, SHAPE, ROOF)
    result = breakdown(overlapped, 1, SHAPE, ROOF)
    assert result["step_us"] == pytest.approx(plain["step_us"])
    assert result["busy_us"] == pytest.approx(plain["busy_us"] + 0.5 * (len(kernels) - 1))
    assert result["idle_us"] == pytest.approx(0.0)
    assert result["overlap_us"] == pytest.approx(2.0 * (len(kernels) - 1))
    assert result["busy_us"] + result["idle_us"] == pytest.approx(result["step_us"])
    assert all(p["us_per_step"] >= 0 for p in result["parts"])
    # Each part's kernels were placed 2 us before the one before ended, or 0.5 us after it.
    assert all(p["start_us"] == pytest.approx(-2.0) for p in result["parts"])
    assert all(p["start_us"] == pytest.approx(0.5) for p in plain["parts"])
    assert "starts us" in format_breakdown("t", result, SHAPE.num_layers)
    assert "overlapping the kernel before" in format_breakdown("t", result, SHAPE.num_layers)
    assert "overlapping" not in format_breakdown("t", plain, SHAPE.num_layers)


def test_the_stretch_between_two_steps_is_listed():
    kernels = step_kernels(steps=3, gap_us=0.5)
    result = breakdown(kernels, 3, SHAPE, ROOF)
    stretch = result["between_steps"]
    # After the LM head: the sampling kernel and a copy, then the next step's first norm.
    names = [k["name"] for k in stretch["kernels"]]
    assert names == [TAIL[2][0], TAIL[3][0], LAYER[0][0]]
    assert [k["start_us"] for k in stretch["kernels"]] == pytest.approx([0.5, 4.0, 5.5])
    assert [k["gap_us"] for k in stretch["kernels"]] == pytest.approx([0.5] * 3)
    assert stretch["span_us"] == pytest.approx(0.5 + 3.0 + 0.5 + 1.0 + 0.5 + 2.0 + 0.5)
    assert "between two steps" in format_breakdown("t", result, SHAPE.num_layers)
    # Runs that are not whole steps name no LM head, and nothing is listed.
    assert breakdown(kernels[:-3], 3, SHAPE, ROOF)["between_steps"] is None


def test_an_empty_window_is_an_error():
    with pytest.raises(ValueError, match="no device kernels"):
        breakdown([], 1, SHAPE, ROOF)


def profiled_decode(tmp_path, device: str, max_num_batched_tokens: int, steps: int):
    import argparse

    from tools.bench_inprocess import make_inprocess_runner, profile_full_decode
    from tools.bench_model import load_model_shape
    from tools.make_tiny_checkpoint import make_checkpoint

    dtype = "bfloat16" if device == "cuda" else "float32"
    path = make_checkpoint(str(tmp_path / "tiny"), arch="qwen3", preset="tiny", seed=0)
    shape = load_model_shape(path)
    args = argparse.Namespace(
        model_path=path,
        device=device,
        dtype=dtype,
        input_len=40,
        output_len=16,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=False,
        seed=0,
        profile_steps=steps,
    )
    runner, config = make_inprocess_runner(args, 4, shape)
    prompts = [[100 + i + j for j in range(40)] for i in range(4)]
    prof, contexts = profile_full_decode(runner, config, prompts, steps)
    return runner, shape, prof, contexts


def test_profile_window_holds_whole_decode_steps_after_a_chunked_prefill(tmp_path):
    # 160 prompt tokens at 48 a step: the first prompts decode while the last are prefilled,
    # so the batch's sequences are at different lengths when the window opens.
    runner, _, prof, contexts = profiled_decode(tmp_path, "cpu", 48, steps=5)
    assert len(contexts) == 4 and min(contexts) > 40 and max(contexts) > min(contexts)
    # The window holds the model's forwards (its RMSNorm reference takes an rsqrt).
    assert any(e.name == "aten::rsqrt" for e in prof.events()), "no model forward profiled"
    # The requests were aborted and the runner dropped their sequences.
    assert not runner.has_pending() and not runner.live.seqs


@pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="needs CUDA: kernels of a real decode"
)
def test_profiled_decode_on_cuda_names_every_projection(tmp_path):
    """A real model's decode steps, in CUDA graphs, profiled: the trace holds the graphs'
    kernels, and every projection and the LM head are found in every step."""
    from tools.bench_common import measure_roofline
    from tools.step_profile import summarize_profile

    steps = 6
    runner, shape, prof, contexts = profiled_decode(tmp_path, "cuda", 0, steps)
    assert len(contexts) == 4 and min(contexts) > 40
    roof = measure_roofline(runner.device, runner.dtype)
    result, table = summarize_profile(prof, steps, shape, roof, contexts, "tiny decode")
    parts = {p["part"]: p for p in result["parts"]}
    for name in ("qkv", "o", "gate_up", "down", LM_HEAD, "decode attention"):
        assert parts[name]["us_per_step"] > 0, table
    assert parts["qkv"]["kernels_per_step"] >= shape.num_layers
    assert result["step_us"] >= result["busy_us"] > 0
