"""CPU smoke runs of every benchmark in tools/ but the serving client (tests/
test_bench_serving_tool.py), at tiny sizes, each through its one command: each must finish,
print a table with a roofline column, and write its JSON and PNG, and the figures it saves
must agree with what it was asked to run."""

from __future__ import annotations

import os
import statistics
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tests.bench_tool_util import (  # noqa: E402
    CPU_SERVER,
    assert_roofline_table,
    outputs,
    refused,
    run_tool,
)

pytestmark = pytest.mark.slow


def test_bench_overhead(micro_dir, tmp_path):
    stdout, _ = run_tool(
        "bench_overhead",
        "--model-path", micro_dir,
        "--batches", "1,3",
        "--input-len", "8",
        "--output-len", "6",
        "--micro-batches", "8,64",
        "--micro-iters", "100",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "overhead")
    assert_roofline_table(stdout, payload)
    micro = payload["microbenchmarks"]
    whats = {(r["what"], r["batch"]) for r in micro}
    for batch in (8, 64):
        for what in ("encode StepPlan", "decode StepPlan", "encode StepResult"):
            assert (what, batch) in whats
        assert ("Scheduler.schedule + on_step_result", batch) in whats
        assert ("worker step prep (apply_diffs + layout + upload)", batch) in whats
        assert ("encode TokenOutputs", batch) in whats
    assert all(r["median_us"] > 0 for r in micro)
    host_step = payload["host_step_us"]["64"]
    assert host_step["full_host_us"] > host_step["target_measure_us"] > host_step["scheduler_us"]
    assert "host time per decode step at batch 64" in stdout
    sizes = {r["batch"]: r["bytes"] for r in micro if r["what"] == "encode StepResult"}
    assert sizes[64] > sizes[8] + 56 * 8  # two packed int32 arrays grow with the batch
    assert "target us" in stdout and "300.00" in stdout
    pipeline = {r["batch"]: r for r in payload["pipeline"]}
    assert set(pipeline) == {1, 3}
    for row in pipeline.values():
        assert row["served_step_ms"] > 0 and row["model_step_ms"] > 0
        assert row["overhead_ms_per_step"] == pytest.approx(
            row["served_step_ms"] - row["model_step_ms"]
        )


def test_bench_startup(micro_dir, tmp_path):
    stdout, _ = run_tool(
        "bench_startup",
        "--model-path", micro_dir,
        "--runs", "1",
        "--idle-seconds", "0.5",
        "--server-args", " ".join(CPU_SERVER),
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "startup")
    assert_roofline_table(stdout, payload)
    median = payload["median"]
    assert 0 < median["ready_s"] < median["first_token_s"] < 300
    assert median["rss_bytes"] > 50e6
    run = payload["runs"][0]
    assert run["exit_code"] == 0
    names = {p["name"] for p in run["memory"]["processes"]}
    for child in ("worker-0", "scheduler", "frontend", "detokenizer", "tokenizer-0"):
        assert f"pegainfer::{child}" in names, names
    # One run: its median is that run's sum over the tree.
    assert median["rss_bytes"] == sum(p["rss"] for p in run["memory"]["processes"])
    assert payload["weights_bytes"] == sum(
        os.path.getsize(os.path.join(micro_dir, f))
        for f in os.listdir(micro_dir)
        if f.endswith(".safetensors")
    )


def test_bench_latency(micro_dir, tmp_path):
    stdout, stderr = run_tool(
        "bench_latency",
        "--model-path", micro_dir,
        "--device", "cpu",
        "--contexts", "8,40",
        "--steps", "6",
        "--warmup-steps", "2",
        "--profile",
        "--out", str(tmp_path),
        env={"PEGAINFER_PROGRESS": "1"},
    )  # fmt: skip
    payload = outputs(tmp_path, "latency")
    assert "profile of 8 decode steps at context 8" in payload["profile"]
    assert (tmp_path / "latency_profile.txt").read_text().strip() == payload["profile"].strip()
    assert_roofline_table(stdout, payload)
    rows = {r["context"]: r for r in payload["results"]}
    assert set(rows) == {8, 40}
    for row in rows.values():
        assert row["steps"] == 6
        assert row["ms_per_step_max"] >= max(row["ms_per_step_median"], row["ms_per_step_mean"])
        assert row["tok_s"] == pytest.approx(1e3 / row["ms_per_step_mean"])
        assert row["roofline_tok_s"] == pytest.approx(1e3 / row["roofline_ms_per_step"])
        assert row["pct_of_roofline"] == pytest.approx(
            100 * row["roofline_ms_per_step"] / row["ms_per_step_mean"]
        )
    # A longer context reads more KV: its floor is higher.
    assert rows[40]["roofline_ms_per_step"] > rows[8]["roofline_ms_per_step"]
    assert "context 40" in stderr  # the progress bar
    # Each context is prefilled three times (the default); the median is its prefill time.
    for row in rows.values():
        assert len(row["prefill_ms_runs"]) == 3
        assert row["prefill_ms"] == pytest.approx(statistics.median(row["prefill_ms_runs"]))
    assert "prefill ms (median of 3)" in stdout


def test_bench_latency_without_parts_of_the_step(micro_dir, tmp_path):
    """``--without`` leaves decode attention and rotary out of the decode steps (timing only)
    and says so in the table; an unknown part is refused before the model loads."""
    stdout, _ = run_tool(
        "bench_latency",
        "--model-path", micro_dir,
        "--device", "cpu",
        "--contexts", "8",
        "--steps", "3",
        "--warmup-steps", "1",
        "--prefill-repeats", "1",
        "--without", "attention,rotary",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "latency")
    assert "without attention and rotary (timing only)" in payload["table"]
    assert payload["args"]["without"] == "attention,rotary"
    assert payload["results"][0]["steps"] == 3
    stderr = refused("bench_latency", "--model-path", micro_dir, "--without", "o")
    assert "--without: unknown step parts o" in stderr


def test_bench_latency_past_the_positions_with_rope_scaling(micro_dir, tmp_path):
    """``--rope-scaling`` takes a context past the micro model's 4,096 positions (YaRN: 1,024
    stretched eight times), which the engine refuses without it."""
    yarn = '{"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024}'
    args = ["--model-path", micro_dir, "--device", "cpu", "--contexts", "4200", "--steps", "2",
            "--warmup-steps", "1", "--prefill-repeats", "1", "--out", str(tmp_path)]  # fmt: skip
    run_tool("bench_latency", *args, "--rope-scaling", yarn)
    (row,) = outputs(tmp_path, "latency")["results"]
    assert row["context"] == 4200 and row["steps"] == 2
    stderr = refused("bench_latency", *args)
    assert "longer than the 4096 positions" in stderr


def test_bench_throughput_inprocess_without_attention(micro_dir, tmp_path):
    """The in-process sweep takes ``--without`` too; the process tree cannot."""
    stdout, _ = run_tool(
        "bench_throughput",
        "--engine", "inprocess",
        "--model-path", micro_dir,
        "--device", "cpu",
        "--batches", "2",
        "--input-len", "8",
        "--output-len", "3",
        "--without", "attention",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "throughput")
    assert "without attention (timing only)" in payload["table"]
    assert payload["results"][0]["output_tokens"] == 6
    stderr = refused("bench_throughput", "--model-path", micro_dir, "--without", "rotary")
    assert "--without needs --engine inprocess" in stderr


def test_bench_ab_alternates_bench_latency_variants(micro_dir, tmp_path):
    stdout, _ = run_tool(
        "bench_ab",
        "--variant", "default:",
        "--variant", "quiet:PEGAINFER_PROGRESS=0",
        "--rounds", "1",
        "--out", str(tmp_path),
        "--",
        sys.executable, "-m", "tools.bench_latency",
        "--model-path", micro_dir, "--device", "cpu", "--contexts", "8",
        "--steps", "4", "--warmup-steps", "1",
    )  # fmt: skip
    payload = outputs(tmp_path, "ab")
    runs = payload["measured"]
    assert set(runs) == {"default", "quiet"}
    for rounds in runs.values():
        ((context, ms),) = rounds[0]
        assert context == 8 and ms > 0
    assert (tmp_path / "default-r1" / "latency.json").exists()
    assert "quiet / default" in stdout


def test_bench_throughput_server_with_hf_baseline(micro_dir, tmp_path):
    stdout, _ = run_tool(
        "bench_throughput",
        "--model-path", micro_dir,
        "--device", "cpu",
        "--batches", "1,2",
        "--input-len", "8",
        "--output-len", "4",
        "--hf-baseline",
        "--hf-batches", "2",
        "--sampling", "mixed",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "throughput")
    assert "mixed sampling" in payload["table"]
    assert_roofline_table(stdout, payload)
    assert payload["engine"] == "server"
    rows = {r["batch"]: r for r in payload["results"]}
    assert set(rows) == {1, 2}
    for batch, row in rows.items():
        assert row["output_tokens"] == batch * 4
        assert row["step_ms"] > 0 and row["roofline_step_ms"] > 0
        assert row["step_x_roofline"] == pytest.approx(row["step_ms"] / row["roofline_step_ms"])
    hf = {r["batch"]: r for r in payload["hf_baseline"]}
    assert set(hf) == {2}
    for batch, row in hf.items():
        assert row["output_tok_s"] > 0
        assert row["speedup"] == pytest.approx(rows[batch]["output_tok_s"] / row["output_tok_s"])
    assert "HF tok/s" in stdout and "speedup" in stdout


def test_bench_throughput_inprocess(micro_dir, tmp_path):
    stdout, _ = run_tool(
        "bench_throughput",
        "--engine", "inprocess",
        "--model-path", micro_dir,
        "--device", "cpu",
        "--batches", "1,3",
        "--input-len", "8",
        "--output-len", "5",
        "--sampling", "qwen3",
        "--profile-batches", "3",
        "--profile-steps", "3",
        "--profile-prefill",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "throughput")
    assert_roofline_table(stdout, payload)
    assert "in-process" in payload["measured_through"]
    assert "qwen3 sampling" in payload["table"]
    for row in payload["results"]:
        assert row["output_tokens"] == row["batch"] * 5
        # The first token comes from the prefill; the other 4 from full-batch decode steps.
        assert row["full_batch_decode_steps"] == 4
    # Profiled after the timed batches, which it leaves alone. On the CPU there are no
    # kernels, so the host ops are shown.
    profiled = {r["batch"]: r.get("profile_table") for r in payload["results"]}
    assert profiled[1] is None
    assert "batch 3" in profiled[3] and "3 steps" in profiled[3] and "host ops" in profiled[3]
    assert profiled[3] in stdout and profiled[3] in payload["table"]
    # The largest batch's prefill, profiled after the decode profiles.
    prefill = {r["batch"]: r.get("prefill_profile_table") for r in payload["results"]}
    assert prefill[1] is None
    assert "3 prompts of 8 tokens" in prefill[3] and "host ops" in prefill[3]
    assert prefill[3] in stdout and prefill[3] in payload["table"]


def test_bench_sampler(tmp_path):
    stdout, _ = run_tool(
        "bench_sampler",
        "--device", "cpu",
        "--vocab", "3000",
        "--batches", "1,4",
        "--calls", "2",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "sampler")
    assert "x floor" in stdout
    from tools.bench_sampler import PRESETS

    assert {(r["preset"], r["batch"]) for r in payload["results"]} == {
        (preset, batch) for preset in PRESETS for batch in (1, 4)
    }
    for row in payload["results"]:
        assert row["ms"] > 0 and row["floor_ms"] > 0
        assert row["times_floor"] == pytest.approx(row["ms"] / row["floor_ms"])


def test_benchmark_requests_take_the_presets_sampling():
    from tools.bench_inprocess import make_requests
    from tools.bench_sampler import PRESETS

    greedy = make_requests([[1, 2]] * 2, 4, "t")
    assert [r.sampling.temperature for r in greedy] == [0.0, 0.0]
    mixed = make_requests([[1, 2]] * 5, 4, "t", PRESETS["mixed"])
    settings = PRESETS["mixed"]
    for j, request in enumerate(mixed):
        for field, value in settings[j % len(settings)].items():
            assert getattr(request.sampling, field) == value
        assert request.sampling.max_tokens == 4 and request.sampling.ignore_eos
