"""CPU smoke runs of the serving benchmark (tools/bench_serving.py) against a micro model's
server, and of the client pieces it shares with the other tools."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tests.bench_tool_util import (  # noqa: E402
    CPU_ENV,
    CPU_SERVER,
    assert_roofline_table,
    outputs,
    run_tool,
)
from tools.bench_launch import ServerProcess  # noqa: E402

pytestmark = pytest.mark.slow


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
