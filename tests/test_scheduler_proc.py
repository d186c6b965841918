"""The scheduler process over its real sockets, with this test playing every neighbour."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zmq

from pegainfer import ipc
from pegainfer.protocol import (
    AbortRequests,
    EngineStats,
    ProcessReady,
    RequestRejected,
    StepPlan,
    StepResult,
    TokenOutputs,
    decode,
    pack_ids,
    unpack_ids,
)
from tests.scheduler_sim import make_config, make_request

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
TIMEOUT_MS = 20_000


def test_scheduler_process_end_to_end(tmp_path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    config = make_config(
        num_kv_blocks=8, tensor_parallel_size=2, run_dir=str(run_dir), log_level="warning"
    )
    config.save(str(run_dir))
    ctx = zmq.Context()
    launcher = ipc.bind(ctx, zmq.PULL, str(run_dir), "launcher")
    workers = [ipc.bind(ctx, zmq.PULL, str(run_dir), f"worker-{rank}") for rank in range(2)]
    detokenizer = ipc.bind(ctx, zmq.PULL, str(run_dir), "detokenizer")
    frontend = ipc.bind(ctx, zmq.PULL, str(run_dir), "frontend")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "PEGAINFER_PARENT_PID": str(os.getpid())}
    proc = subprocess.Popen(
        [sys.executable, "-m", "scheduler_proc", "--run-dir", str(run_dir)], env=env, cwd=REPO_ROOT
    )

    def next_plan() -> StepPlan:
        assert workers[0].poll(TIMEOUT_MS) and workers[1].poll(TIMEOUT_MS)
        data = [worker.recv() for worker in workers]
        assert data[0] == data[1], "every rank gets the same plan"
        return decode(data[0], (StepPlan,))

    def answer(plan: StepPlan, token: int) -> TokenOutputs:
        seq_ids = unpack_ids(plan.seq_ids)
        ipc.send(inbound, StepResult(plan.step_id, pack_ids(seq_ids), pack_ids([token])))
        outputs = ipc.recv(detokenizer, (TokenOutputs,), "detokenizer", TIMEOUT_MS)
        assert isinstance(outputs, TokenOutputs)
        return outputs

    try:
        ready = ipc.recv(launcher, (ProcessReady,), "launcher", timeout_ms=30_000)
        assert isinstance(ready, ProcessReady) and ready.name == "scheduler"
        assert ready.info["num_kv_blocks"] == 8
        inbound = ipc.connect(ctx, zmq.PUSH, str(run_dir), "scheduler")

        inbound.send(b"\x93garbage")  # malformed: logged and dropped
        ipc.send(inbound, AbortRequests(["nobody"]))  # unknown: ignored
        ipc.send(inbound, make_request("huge", list(range(3, 40)), max_tokens=1))
        # The frontend socket also carries the scheduler's periodic EngineStats.
        rejected = ipc.recv(frontend, None, "frontend", TIMEOUT_MS)
        while isinstance(rejected, EngineStats):
            rejected = ipc.recv(frontend, None, "frontend", TIMEOUT_MS)
        assert isinstance(rejected, RequestRejected) and rejected.status == 400

        ipc.send(inbound, make_request("r", [3, 4, 5], max_tokens=2))
        plan = next_plan()
        assert [s.seq_id for s in plan.new_seqs] == unpack_ids(plan.seq_ids)
        first = answer(plan, 11)
        assert [(o.request_id, unpack_ids(o.new_token_ids)) for o in first.outputs] == [("r", [11])]
        second = answer(next_plan(), 12)
        assert second.outputs[0].finish_reason == "length"
        assert second.outputs[0].completion_tokens == 2

        # A running request aborted: one finish event, then its seq is dropped on the workers.
        ipc.send(inbound, make_request("s", [3, 4], max_tokens=20))
        s_plan = next_plan()
        answer(s_plan, 13)
        next_plan()  # its decode step, left unanswered
        ipc.send(inbound, AbortRequests(["s"]))
        aborted = ipc.recv(detokenizer, (TokenOutputs,), "detokenizer", TIMEOUT_MS)
        assert [(o.request_id, o.finish_reason) for o in aborted.outputs] == [("s", "abort")]

        # A worker error stops the scheduler with a non-zero status.
        ipc.send(inbound, StepResult(step_id=99, seq_ids=b"", token_ids=b"", error="GPU fell off"))
        assert proc.wait(timeout=20) != 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
        ctx.destroy(linger=0)
