"""CPU smoke runs of every benchmark in tools/, at tiny sizes, each through its one command:
each must finish, print a table with a roofline column, and write its JSON and PNG, and the
figures it saves must agree with what it was asked to run."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tools.bench_launch import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CPU_SERVER = ["--device", "cpu", "--max-model-len", "128", "--kv-cache-memory", "16MiB"]
# One OMP thread per model: on a small, busy machine two threads per process thrash, and a
# micro model's step goes from a few ms to tens.
CPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def micro_dir(tmp_path_factory) -> str:
    from tools.make_tiny_checkpoint import make_checkpoint

    out = tmp_path_factory.mktemp("micro-qwen3")
    return make_checkpoint(str(out), arch="qwen3", preset="micro", seed=0, dtype="float32")


def _run(module: str, *args: str, env: dict[str, str] | None = None):
    return subprocess.run(
        [sys.executable, "-m", f"tools.{module}", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **CPU_ENV, **(env or {})},
    )


def run_tool(module: str, *args: str, env: dict[str, str] | None = None) -> tuple[str, str]:
    proc = _run(module, *args, env=env)
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, proc.stderr


def refused(module: str, *args: str) -> str:
    """The error output of a tool run that must fail."""
    proc = _run(module, *args)
    assert proc.returncode != 0, f"{module} ran:\n{proc.stdout[-3000:]}"
    return proc.stderr


def outputs(out_dir, name: str) -> dict:
    png = out_dir / f"{name}.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000
    return json.loads((out_dir / f"{name}.json").read_text())


def assert_roofline_table(stdout: str, payload: dict) -> None:
    header = [line for line in stdout.splitlines() if "roofline" in line and "  " in line]
    assert header, stdout
    assert payload["table"] and "roofline" in payload["table"]


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


@pytest.fixture(scope="module")
def micro_server(micro_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serving") / "server.log"
    with ServerProcess(micro_dir, CPU_SERVER, log_path=str(log), env=CPU_ENV) as server:
        server.wait_ready(timeout=300)
        yield server
    assert server.proc.returncode == 0, server.log_tail()


def run_serving(capsys, *args: str) -> str:
    # In this process: it imports nothing heavy, and a fresh interpreter costs seconds here.
    from tools import bench_serving

    bench_serving.main(list(args))
    return capsys.readouterr().out


def test_bench_serving_poisson(micro_server, micro_dir, tmp_path, capsys):
    stdout = run_serving(
        capsys,
        "--url", micro_server.base_url,
        "--num-prompts", "6",
        "--request-rate", "50",
        "--input-len", "12",
        "--input-len-range", "0.5",
        "--output-len", "5",
        "--roofline-device", "cpu",
        "--sampling", "qwen3-presence",
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "serving")
    assert_roofline_table(stdout, payload)
    assert "qwen3-presence sampling" in stdout
    summary = payload["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 6 * 5  # ignore_eos: exactly max_tokens each
    lens = [r["prompt_len"] for r in payload["requests"]]
    assert min(lens) >= 6 and max(lens) <= 18
    assert summary["total_input_tokens"] == sum(lens)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert summary[key]["p50"] > 0 and summary[key]["p99"] >= summary[key]["p50"]
    assert summary["e2el_ms"]["p50"] >= summary["ttft_ms"]["p50"]
    assert [row["metric"] for row in payload["results"]] == [
        "ttft_ms",
        "tpot_ms",
        "itl_ms",
        "e2el_ms",
    ]
    assert payload["results"][1] == {"metric": "tpot_ms", **summary["tpot_ms"]}
    # The roofline read the model's shape from the server's /v1/models root.
    assert payload["roofline"]["step_ms"] > 0 and payload["roofline"]["batch"] >= 1


def test_bench_serving_chat_turns_with_a_constraint(tiny_qwen3_dir, tmp_path, capsys, monkeypatch):
    # The tiny Qwen3: the micro one's vocabulary stops short of the chat template's tokens.
    for name, value in CPU_ENV.items():
        monkeypatch.setenv(name, value)
    stdout = run_serving(
        capsys,
        "--launch",
        "--model-path", tiny_qwen3_dir,
        "--server-args", " ".join(CPU_SERVER),
        "--num-prompts", "4",
        "--concurrency", "2",
        "--input-len", "10",
        "--output-len", "5",
        "--roofline-device", "none",
        "--endpoint", "chat",
        "--structured", "json",
        "--chat-template-kwargs", '{"enable_thinking": false}',
        "--out", str(tmp_path),
    )  # fmt: skip
    payload = outputs(tmp_path, "serving")
    assert "json constraint, chat" in stdout
    summary = payload["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0
    # The prompt lengths come from the usage: the text and the chat template's tokens.
    assert all(r["prompt_len"] > 10 for r in payload["requests"])


def test_bench_serving_launches_its_server_and_bounds_concurrency(
    micro_dir, tmp_path, capsys, monkeypatch
):
    for name, value in CPU_ENV.items():
        monkeypatch.setenv(name, value)  # inherited by the server it starts
    stdout = run_serving(
        capsys,
        "--launch",
        "--model-path", micro_dir,
        "--server-args", " ".join(CPU_SERVER),
        "--num-prompts", "4",
        "--concurrency", "2",
        "--input-len", "8",
        "--output-len", "3",
        "--roofline-device", "none",
        "--out", str(tmp_path),
        "--name", "conc",
    )  # fmt: skip
    payload = outputs(tmp_path, "conc")
    summary = payload["summary"]
    assert summary["completed"] == 4 and summary["total_output_tokens"] == 12
    assert payload["url"].startswith("http://127.0.0.1:")
    assert (tmp_path / "conc-server.log").stat().st_size > 0
    # At most 2 in flight: the mean number in the system cannot exceed it.
    assert summary["mean_concurrency"] <= 2.05
    assert "% of roofline" in stdout


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


def test_bench_ab_alternates_serving_runs(micro_server, tmp_path):
    """Serving runs compared over alternated runs, a latency a row."""
    stdout, _ = run_tool(
        "bench_ab",
        "--variant", "a:",
        "--variant", "b:PEGAINFER_PROGRESS=0",
        "--rounds", "1",
        "--key", "metric",
        "--metric", "mean",
        "--out", str(tmp_path),
        "--",
        sys.executable, "-m", "tools.bench_serving",
        "--url", micro_server.base_url, "--num-prompts", "3", "--request-rate", "inf",
        "--input-len", "8", "--output-len", "3", "--roofline-device", "none",
    )  # fmt: skip
    runs = outputs(tmp_path, "ab")["measured"]
    for rounds in runs.values():
        assert [metric for metric, _ in rounds[0]] == ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"]
        assert all(value > 0 for _, value in rounds[0])
    assert "b / a" in stdout


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


def test_bench_serving_stops_at_its_time_limit(micro_server, tmp_path, capsys):
    run_serving(
        capsys,
        "--url", micro_server.base_url,
        "--num-prompts", "50",
        "--request-rate", "5",
        "--input-len", "8",
        "--output-len", "120",
        "--max-duration", "0.05",
        "--warmup", "0",
        "--roofline-device", "none",
        "--out", str(tmp_path),
    )  # fmt: skip
    summary = json.loads((tmp_path / "serving.json").read_text())["summary"]
    # 50 ms at 5 requests/s: the first request goes at once (a few more at most) and none
    # of 120 tokens finishes (that takes 120 steps of the whole pipeline); the rest are
    # never sent.
    assert summary["completed"] + summary["failed"] < 20
    assert summary["failed"] >= 1 and "time limit reached" in summary["errors"]
    assert summary["duration_s"] < 5


def test_free_ports_come_from_below_the_ephemeral_range():
    import socket

    from tools.bench_launch import ephemeral_port_range, free_port

    low, _ = ephemeral_port_range()
    for count in (1, 4):
        base = free_port(count)
        if low > 10_000 + count:
            assert 10_000 <= base and base + count <= low
        for port in range(base, base + count):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


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


def test_the_serving_client_leaves_out_the_fields_the_server_should_default():
    """`bench_serving --sampling server` sends no sampling field, as `vllm bench serve` does,
    so that the server's defaults (its model's generation_config.json) apply."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from tools.bench_client import stream_completion
    from tools.bench_serving import request_sampling

    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        await response.write(b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    async def go() -> list:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                return [
                    await stream_completion(session, url, "m", [1, 2], 1, extra=extra)
                    for extra in (
                        *request_sampling("server"),
                        *request_sampling("qwen3"),
                        *request_sampling("greedy", "json"),
                    )
                ]
        finally:
            await runner.cleanup()

    results = asyncio.run(go())
    assert all(r.ok and r.output_tokens == 1 for r in results)
    server_defaults, qwen3, constrained = bodies
    assert constrained["temperature"] == 0.0
    assert constrained["response_format"]["json_schema"]["schema"]["required"] == ["notes"]
    assert not {"temperature", "top_p", "top_k"} & set(server_defaults)
    assert server_defaults["max_tokens"] == 1 and server_defaults["ignore_eos"] is True
    assert (qwen3["temperature"], qwen3["top_p"], qwen3["top_k"]) == (0.6, 0.95, 20)
