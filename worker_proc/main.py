"""The worker process: one per tensor-parallel rank.

``python -m worker_proc --run-dir DIR --rank R``. Loads the model and KV cache, reports
ready to the launcher (with the number of KV blocks), then executes step plans from the
scheduler in order; rank 0 sends each step's sampled tokens back. A failing step is fatal:
the worker reports the error in a StepResult, and exits non-zero so that the launcher tears
the tree down (a worker whose state may be inconsistent must not keep serving).
"""

from __future__ import annotations

import logging
import sys
import time
import traceback

import zmq

from pegainfer import ipc
from pegainfer.process import child_args, init_child, report_ready
from pegainfer.protocol import StepPlan, StepResult

logger = logging.getLogger("worker_proc")

POLL_MS = 100  # wake up this often so signal handlers run while idle


def serve(runner, plans: zmq.Socket, results: zmq.Socket | None) -> int:
    """Execute plans until one fails; returns the exit status (only ever non-zero)."""
    while True:
        plan = ipc.recv(plans, (StepPlan,), "worker plans", timeout_ms=POLL_MS)
        if plan is None:
            continue
        try:
            result = runner.execute(plan)
        except Exception as exc:  # any failure leaves the KV state suspect: stop
            logger.error("step %d failed:\n%s", plan.step_id, traceback.format_exc())
            if results is not None:
                error = f"{type(exc).__name__}: {exc}"
                ipc.send(
                    results,
                    StepResult(step_id=plan.step_id, seq_ids=b"", token_ids=b"", error=error),
                )
            return 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %d: %d seqs, %d new, %d sampled",
                plan.step_id,
                len(plan.seq_ids) // 4,
                len(plan.new_seqs),
                len(result.seq_ids) // 4,
            )
        if results is not None:
            ipc.send(results, result)


def main() -> int:
    args = child_args("pegainfer worker: one tensor-parallel rank", with_rank=True)
    name = f"worker-{args.rank}"
    config = init_child(name, args.run_dir)
    ctx = zmq.Context()
    plans = ipc.bind(ctx, zmq.PULL, args.run_dir, name)
    results = ipc.connect(ctx, zmq.PUSH, args.run_dir, "scheduler") if args.rank == 0 else None

    started = time.monotonic()
    from worker_proc.model_runner import ModelRunner  # torch loads here, after naming

    try:
        runner = ModelRunner(config, args.rank)
    except Exception:
        logger.exception("%s failed to start", name)
        return 1
    logger.info(
        "%s ready in %.2f s (weights %.2f s): %s on %s, %s, %d KV blocks of %d tokens",
        name,
        time.monotonic() - started,
        runner.load_seconds,
        runner.model_config.architecture,
        runner.device,
        str(runner.dtype).removeprefix("torch."),
        runner.num_kv_blocks,
        runner.block_size,
    )
    report_ready(
        ctx,
        args.run_dir,
        name,
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
    )
    status = serve(runner, plans, results)
    if results is not None:
        # LINGER is 0 on our sockets; let the error result leave before exiting.
        results.close(linger=2000)
    plans.close()
    ctx.term()
    logging.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
