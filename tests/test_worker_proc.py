"""The worker as a real process: ready report, step plans in, step results out, malformed
messages dropped, a failing plan reported and fatal, SIGTERM honoured."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import zmq
from worker_helpers import engine_config, greedy_reference, make_tiny_checkpoint

from pegainfer import ipc
from pegainfer.protocol import (
    BlockTableUpdate,
    NewSequence,
    ProcessReady,
    SamplingParams,
    StepPlan,
    StepResult,
    pack_ids,
    unpack_ids,
)

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama", seed=5)


@pytest.fixture
def worker(checkpoint, tmp_path):
    run_dir = str(tmp_path / "run")
    os.mkdir(run_dir, 0o700)
    config = engine_config(checkpoint)
    config.run_dir = run_dir
    config.save(run_dir)
    ctx = zmq.Context()
    launcher = ipc.bind(ctx, zmq.PULL, run_dir, "launcher")
    scheduler = ipc.bind(ctx, zmq.PULL, run_dir, "scheduler")
    env = {
        **os.environ,
        "PEGAINFER_PARENT_PID": str(os.getpid()),
        "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker_proc", "--run-dir", run_dir, "--rank", "0"],
        cwd=REPO,
        env=env,
    )
    try:
        ready = ipc.recv(launcher, (ProcessReady,), "test launcher", timeout_ms=60_000)
        assert ready is not None, "worker did not report ready"
        plans = ipc.connect(ctx, zmq.PUSH, run_dir, "worker-0")
        yield proc, ready, plans, scheduler
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)


def _plan(step_id: int, seq_id: int, tokens: list[int], known: bool = False) -> StepPlan:
    new = [] if known else [NewSequence(seq_id, pack_ids(tokens), SamplingParams(temperature=0), 3)]
    return StepPlan(
        step_id=step_id,
        new_seqs=new,
        seq_ids=pack_ids([seq_id]),
        num_computed=pack_ids([0]),
        num_scheduled=pack_ids([len(tokens)]),
        block_updates=[] if known else [BlockTableUpdate(seq_id, pack_ids([2]))],
        finished_seq_ids=b"",
    )


def test_worker_serves_plans_and_dies_on_a_bad_one(worker):
    proc, ready, plans, scheduler = worker
    assert ready.name == "worker-0" and ready.pid == proc.pid
    assert ready.info["num_kv_blocks"] == 512 and ready.info["block_size"] == 4
    assert ready.info["device"] == "cpu" and ready.info["dtype"] == "float32"

    plans.send(b"\x93not a plan")  # malformed: logged and dropped
    ipc.send(plans, _plan(0, 7, [1, 2, 3]))
    result = ipc.recv(scheduler, (StepResult,), "test scheduler", timeout_ms=30_000)
    assert result is not None and result.error is None and result.step_id == 0
    assert unpack_ids(result.seq_ids) == [7]
    assert 0 <= unpack_ids(result.token_ids)[0] < 512

    ipc.send(plans, _plan(1, 99, [1], known=True))  # sequence 99 was never sent
    result = ipc.recv(scheduler, (StepResult,), "test scheduler", timeout_ms=30_000)
    assert result is not None and result.step_id == 1
    assert result.seq_ids == b"" and "unknown sequence 99" in result.error
    assert proc.wait(timeout=30) == 1


def test_worker_exits_on_sigterm(worker):
    proc, _, _, _ = worker
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_worker_runs_plans_sent_back_to_back(worker, checkpoint):
    """Three plans sent without waiting (as with two steps in flight): each decode reads
    the token the step before sampled; the results come back in order and equal plain
    greedy decoding."""
    from worker_proc.model_runner import ModelRunner

    _, _, plans, scheduler = worker
    prompt = [1, 2, 3]
    ipc.send(plans, _plan(0, 7, prompt))
    for step in (1, 2):
        ipc.send(
            plans,
            StepPlan(
                step_id=step,
                new_seqs=[],
                seq_ids=pack_ids([7]),
                num_computed=pack_ids([2 + step]),
                num_scheduled=pack_ids([1]),
                block_updates=[BlockTableUpdate(7, pack_ids([5]))] if step == 2 else [],
                finished_seq_ids=b"",
            ),
        )
    results = [ipc.recv(scheduler, (StepResult,), "test", timeout_ms=30_000) for _ in range(3)]
    assert [r.step_id for r in results] == [0, 1, 2]
    assert all(r.error is None and unpack_ids(r.seq_ids) == [7] for r in results)
    tokens = [unpack_ids(r.token_ids)[0] for r in results]
    assert tokens == greedy_reference(ModelRunner(engine_config(checkpoint)), prompt, 3)
