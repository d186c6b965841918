"""The worker process: one per tensor-parallel rank.

``python -m worker_proc --run-dir DIR --rank R``. Loads the model and KV cache (and captures
the decode graphs), reports ready to the launcher (with the number of KV blocks), then runs
step plans from the scheduler in order; rank 0 sends each step's sampled tokens back.

The loop overlaps steps: a plan is launched as soon as it arrives, without waiting for the
previous step's tokens to reach the host, and each result is sent as soon as its tokens
have arrived. The scheduler keeps up to two plans in flight, so the GPU has the next step
queued while the host sends one result and receives the next plan.

A failing step is fatal: the worker reports the error in a StepResult, and exits non-zero
so that the launcher tears the tree down (a worker whose state may be inconsistent must not
keep serving).
"""

from __future__ import annotations

import logging
import sys
import time
import traceback

import zmq

from pegainfer import ipc
from pegainfer.gc_control import freeze_imports
from pegainfer.multinode import local_rank, worker_plan_socket
from pegainfer.process import at_stop, child_args, init_child, report_ready
from pegainfer.protocol import StepMasks, StepPlan, StepResult
from pegainfer.startup_timeline import StartupTimeline
from worker_proc.cuda_context import device_ordinal, start_primary_context

logger = logging.getLogger("worker_proc")

POLL_MS = 100  # wake up this often so signal handlers run while idle
# While a step runs on the device, spin (checking for plans and finished steps) this long
# before waiting in 1 ms sleeps. Decode steps and short prefills take a few ms up to a few
# tens: spinning through them hands each result on the moment it is ready, where a 1 ms
# sleep would add half a millisecond to every token on average. Only a long prefill
# sleeps.
SPIN_S = 0.05


def _report_failure(results: zmq.Socket | None, step_id: int | None, exc: Exception) -> None:
    logger.error("step %s failed:\n%s", step_id, traceback.format_exc())
    if results is not None:
        error = f"{type(exc).__name__}: {exc}"
        step = -1 if step_id is None else step_id
        ipc.send(results, StepResult(step_id=step, seq_ids=b"", token_ids=b"", error=error))


def serve(runner, plans: zmq.Socket, results: zmq.Socket | None) -> int:
    """Run plans until one fails; returns the exit status (only ever non-zero).

    ``runner`` offers ``submit(plan)``, ``supply_masks(masks)``, ``poll_results(wait)`` and
    ``has_pending()``. A plan with ``masks_follow`` is drawn from once its StepMasks comes;
    the results of the steps before it go out meanwhile, since its masks wait for them."""
    waiting_since: float | None = None
    from worker_proc.parallel_state import StepOrderCheck

    step_order = StepOrderCheck()  # every rank runs the same steps in the same order
    while True:
        try:
            ready = runner.poll_results(wait=False)
        except Exception as exc:  # a device error surfaces when a step's copy completes
            _report_failure(results, runner.oldest_pending_step_id, exc)
            return 1
        for result in ready:
            if results is not None:
                ipc.send(results, result)
        busy = runner.has_pending()
        if ready or not busy:
            waiting_since = None
        if busy and runner.waits_only_for_masks():
            # Nothing queued on the device: only the masks' message can move the step on,
            # and the socket wakes for it at once; spinning would take a core meanwhile.
            timeout = POLL_MS
        elif busy:
            # A plan may arrive while the device works: launch it right away.
            now = time.monotonic()
            waiting_since = waiting_since or now
            timeout = 0 if now - waiting_since < SPIN_S else 1
        else:
            timeout = POLL_MS
        plan = ipc.recv(plans, (StepPlan, StepMasks), "worker plans", timeout_ms=timeout)
        if plan is None:
            continue
        try:
            if isinstance(plan, StepMasks):
                runner.supply_masks(plan)  # a queued step's draw, waiting for them
                continue
            step_order.check(plan)
            runner.submit(plan)
        except Exception as exc:  # any failure leaves the KV state suspect: stop
            _report_failure(results, plan.step_id, exc)
            return 1
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step %d: %d seqs, %d new",
                plan.step_id,
                len(plan.seq_ids) // 4,
                len(plan.new_seqs),
            )


def main() -> int:
    timeline = StartupTimeline()  # from the process's creation: interpreter and imports
    args = child_args("pegainfer worker: one tensor-parallel rank", with_rank=True)
    name = f"worker-{args.rank}"
    config = init_child(name, args.run_dir)
    # The CUDA context is created while torch imports (worker_proc/cuda_context.py).
    context_thread = start_primary_context(
        device_ordinal(config.device, local_rank(config, args.rank))
    )
    ctx = zmq.Context()
    plans = worker_plan_socket(ctx, config, args.rank)  # ipc, or TCP from another node
    results = ipc.connect(ctx, zmq.PUSH, args.run_dir, "scheduler") if args.rank == 0 else None

    timeline.mark("setup")
    from worker_proc.model_runner import ModelRunner  # torch loads here, after naming

    timeline.mark("torch import")
    freeze_imports()  # the collector was off for the imports (worker_proc/__main__.py)
    if context_thread is not None:
        context_thread.join()
        timeline.mark("cuda context")
    try:
        runner = ModelRunner(config, args.rank, timeline=timeline)
    except Exception:
        logger.exception("%s failed to start", name)
        return 1
    logger.info(timeline.summary())
    logger.info(
        "%s ready in %.2f s (weights %.2f s): %s on %s, %s, %d KV blocks of %d tokens",
        name,
        timeline.total,
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
        decode_graphs=len(runner.graphs.sizes) if runner.graphs is not None else 0,
        graph_capture_s=round(runner.graph_capture_seconds, 3),
    )
    # After start-up's compiles: any later one stalls the step that launched it. (The CPU
    # path runs no Triton kernel, and importing Triton there would only cost memory.)
    from kernels.compile_watch import watch_late_compiles

    watch = watch_late_compiles(name) if runner.device.type == "cuda" else None
    if watch is not None:
        at_stop(lambda: logger.info("%s: %s", name, watch.summary()))
    status = serve(runner, plans, results)
    if watch is not None:
        logger.info("%s: %s", name, watch.summary())
    if results is not None:
        # LINGER is 0 on our sockets; let the error result leave before exiting.
        results.close(linger=2000)
    plans.close()
    ctx.term()
    logging.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
