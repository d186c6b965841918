"""Microbenchmarks of the host-side hot path of a decode step, on the CPU: protocol
encode/decode of its StepPlan, StepResult and TokenOutputs, one Scheduler step (schedule +
on_step_result), and the worker's host-side preparation of the step (plan diffs, layout,
upload arrays) without running the model.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

SCHEDULER_TARGET_MS = 0.3
WORKER_PREP = "worker step prep (apply_diffs + layout + upload)"


def time_us(fn: Callable[[], Any], iters: int) -> dict[str, float]:
    """Median and mean microseconds of ``fn`` over ``iters`` calls (after a short warm-up)."""
    for _ in range(min(50, iters)):
        fn()
    samples = []
    for _ in range(iters):
        began = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - began) / 1e3)
    return {"median_us": statistics.median(samples), "mean_us": statistics.fmean(samples)}


def decode_plan(batch: int, step_id: int = 7, context: int = 300) -> Any:
    """A typical decode step: every sequence schedules one token; one in block_size (16)
    crosses into a new block and gets a block update; none finished."""
    from pegainfer.protocol import BlockTableUpdate, StepPlan, pack_ids

    rng = random.Random(batch)
    updates = [
        BlockTableUpdate(seq_id, pack_ids([rng.randrange(100_000)]))
        for seq_id in range(0, batch, 16)
    ]
    return StepPlan(
        step_id=step_id,
        new_seqs=[],
        seq_ids=pack_ids(range(batch)),
        num_computed=pack_ids([context + i % 50 for i in range(batch)]),
        num_scheduled=pack_ids([1] * batch),
        block_updates=updates,
        finished_seq_ids=b"",
    )


def decode_outputs(batch: int) -> Any:
    """The scheduler's report of a decode step to the detokenizer: one token per request."""
    from pegainfer.protocol import SeqOutput, TokenOutputs, pack_ids

    return TokenOutputs(
        [SeqOutput(f"cmpl-{i:08x}", pack_ids([1234]), None, None, 300, 50, 0) for i in range(batch)]
    )


def protocol_micro(batches: list[int], iters: int) -> list[dict[str, Any]]:
    """Encode and decode of a decode step's messages: the plan (scheduler to workers), the
    result (worker to scheduler) and the new tokens (scheduler to detokenizer)."""
    from pegainfer.protocol import StepResult, decode, encode, pack_ids

    rows = []
    for batch in batches:
        cases = []
        for name, msg in (
            ("StepPlan", decode_plan(batch)),
            ("StepResult", StepResult(7, pack_ids(range(batch)), pack_ids([1234] * batch))),
            ("TokenOutputs", decode_outputs(batch)),
        ):
            data = encode(msg)
            cases.append((f"encode {name}", lambda m=msg: encode(m), len(data)))
            kind = type(msg)
            cases.append((f"decode {name}", lambda b=data, t=kind: decode(b, (t,)), len(data)))
        for label, fn, size in cases:
            rows.append({"what": label, "batch": batch, "bytes": size, **time_us(fn, iters)})
    return rows


def scheduler_config(batch: int, max_model_len: int) -> Any:
    from pegainfer.config import EngineConfig, ModelInfo, finalize

    model = ModelInfo(
        architecture="Qwen3ForCausalLM",
        vocab_size=4096,
        max_position_embeddings=max_model_len,
        eos_token_ids=[2],
        bos_token_id=None,
        num_hidden_layers=2,
        num_kv_heads=2,
        head_dim=32,
        hidden_size=64,
    )
    config = EngineConfig(
        model_path="(none)",
        served_model_name="bench",
        max_num_seqs=batch,
        max_model_len=max_model_len,
        max_num_batched_tokens=8192,
        block_size=16,
        num_kv_blocks=batch * (max_model_len // 16 + 2),
        model=model,
    )
    return finalize(config)


def _scheduler_step(scheduler: Any, known: dict[int, int]) -> tuple[float, float]:
    """One step planned and answered as a worker would (a sequence samples token 7 when its
    computed tokens reach the length it knows, ``known``); the microseconds of schedule()
    and of on_step_result()."""
    from pegainfer.protocol import StepResult, pack_ids, unpack_ids

    began = time.perf_counter_ns()
    plan = scheduler.schedule()
    planned = time.perf_counter_ns()
    if plan is None:
        raise RuntimeError("the scheduler planned no step")
    samplers = []
    for seq_id, computed, scheduled in zip(
        unpack_ids(plan.seq_ids), unpack_ids(plan.num_computed), unpack_ids(plan.num_scheduled)
    ):
        if computed + scheduled == known[seq_id]:
            samplers.append(seq_id)
            known[seq_id] += 1
    result = StepResult(plan.step_id, pack_ids(samplers), pack_ids([7] * len(samplers)))
    answered = time.perf_counter_ns()
    scheduler.on_step_result(result)
    return (planned - began) / 1e3, (time.perf_counter_ns() - answered) / 1e3


def scheduler_micro(batches: list[int], iters: int) -> list[dict[str, Any]]:
    """schedule() + on_step_result() per decode step of a full batch, as the scheduler process
    runs them (default config: prefix caching on)."""
    from pegainfer.protocol import SamplingParams, TokenizedRequest, pack_ids
    from scheduler_proc.scheduler import Scheduler

    rows = []
    prompt_len = 128
    for batch in batches:
        max_model_len = prompt_len + iters + 256
        scheduler = Scheduler(scheduler_config(batch, max_model_len))
        sampling = SamplingParams(max_tokens=iters + 128, temperature=0.0, ignore_eos=True)
        rng = random.Random(batch)
        for j in range(batch):
            prompt = [rng.randrange(3, 4096) for _ in range(prompt_len)]
            scheduler.add_request(TokenizedRequest(f"r{j}", pack_ids(prompt), sampling, 0.0))
        # Seq ids are given in arrival order from 0; each knows its prompt at first.
        known = dict.fromkeys(range(batch), prompt_len)
        for _ in range(20):  # the prefill steps, then a few decodes
            _scheduler_step(scheduler, known)
        if scheduler.num_running != batch:
            raise RuntimeError(f"{scheduler.num_running} of {batch} requests running")
        samples = [_scheduler_step(scheduler, known) for _ in range(iters)]
        schedule_us = statistics.median(s[0] for s in samples)
        result_us = statistics.median(s[1] for s in samples)
        total = statistics.median(s[0] + s[1] for s in samples)
        rows.append(
            {
                "what": "Scheduler.schedule + on_step_result",
                "batch": batch,
                "schedule_us": schedule_us,
                "on_step_result_us": result_us,
                "median_us": total,
                "mean_us": statistics.fmean(s[0] + s[1] for s in samples),
            }
        )
    return rows


def _worker_state(batch: int, context: int, max_model_len: int) -> tuple[Any, Any]:
    """A CPU worker's live sequences and uploader, with ``batch`` sequences started on
    contexts ``context + i % 50`` (every block they need already sent)."""
    import torch

    from pegainfer.protocol import BlockTableUpdate, NewSequence, SamplingParams, StepPlan, pack_ids
    from worker_proc.live_seqs import LiveSequences
    from worker_proc.seq_slots import SlotTable
    from worker_proc.upload import Uploader

    block_size = 16
    max_blocks = -(-max_model_len // block_size)
    device = torch.device("cpu")
    uploader = Uploader(device)
    live = LiveSequences(
        SlotTable(batch, max_blocks, device), uploader, 4096, batch * max_blocks, block_size
    )
    sampling = SamplingParams(max_tokens=max_model_len, temperature=0.0)
    new_seqs, updates = [], []
    for seq_id in range(batch):
        length = context + seq_id % 50
        new_seqs.append(NewSequence(seq_id, pack_ids([5] * length), sampling, length))
        first = seq_id * max_blocks
        num_blocks = -(-length // block_size)
        updates.append(BlockTableUpdate(seq_id, pack_ids(range(first, first + num_blocks))))
    live.apply_diffs(StepPlan(0, new_seqs, b"", b"", b"", updates, b""))
    return live, uploader


def worker_micro(batches: list[int], iters: int) -> list[dict[str, Any]]:
    """The worker's host-side preparation of a decode step, before anything runs on the
    device: the plan's diffs applied (``live.apply_diffs``), its batch checked, the step laid
    out (``layout_step``) and its arrays packed for the one upload. Overlapped as on a GPU:
    each sequence's input token is the one the step before sampled, still on the device."""
    from pegainfer.protocol import BlockTableUpdate, StepPlan, pack_ids, unpack_ids
    from worker_proc.batch import layout_step

    rows = []
    block_size, context = 16, 300
    for batch in batches:
        max_model_len = context + 64 + iters + 64
        max_blocks = -(-max_model_len // block_size)
        live, uploader = _worker_state(batch, context, max_model_len)
        seqs = [live.seqs[seq_id] for seq_id in range(batch)]
        positions = [seq.num_tokens for seq in seqs]
        for seq in seqs:
            seq.num_tokens += 1  # a first token sampled, not yet on the host
        scratch = live.slots.scratch_slot
        seq_ids = pack_ids(range(batch))
        ones = pack_ids([1] * batch)
        samples = []
        for step in range(1, iters + 50):
            # A block for every sequence whose token of this step starts one.
            updates = [
                BlockTableUpdate(i, pack_ids([i * max_blocks + p // block_size]))
                for i, p in enumerate(positions)
                if p % block_size == 0
            ]
            plan = StepPlan(step, [], seq_ids, pack_ids(positions), ones, updates, b"")
            began = time.perf_counter_ns()
            live.apply_diffs(plan)
            num_computed = unpack_ids(plan.num_computed)
            num_scheduled = unpack_ids(plan.num_scheduled)
            step_seqs = live.batch(unpack_ids(plan.seq_ids), num_computed, num_scheduled)
            layout = layout_step(step_seqs, num_computed, num_scheduled, block_size, None, scratch)
            uploader.upload(layout.arrays())
            samples.append((time.perf_counter_ns() - began) / 1e3)
            if len(layout.sample_rows) != batch or len(layout.pending_index) != batch:
                raise RuntimeError("the benchmark's decode step is not the overlapped one")
            for seq in seqs:  # what sampling and the copy back do to the host state
                seq.num_tokens += 1
                seq.token_ids.append(7)
            positions = [p + 1 for p in positions]
        samples = samples[50:]
        rows.append(
            {
                "what": WORKER_PREP,
                "batch": batch,
                "median_us": statistics.median(samples),
                "mean_us": statistics.fmean(samples),
            }
        )
    return rows


def host_step_summary(rows: list[dict[str, Any]], batch: int) -> dict[str, float] | None:
    """The host time of one decode step at ``batch``, from the microbenchmark rows: what
    the target counts (the scheduler's step plus encode and decode of the plan and of the
    result), then what else the host spends on the step (the worker's preparation, the
    scheduler's encode of the new tokens)."""
    medians = {r["what"]: r["median_us"] for r in rows if r["batch"] == batch}
    parts = {
        "scheduler_us": "Scheduler.schedule + on_step_result",
        "plan_codec_us": ("encode StepPlan", "decode StepPlan"),
        "result_codec_us": ("encode StepResult", "decode StepResult"),
        "worker_prep_us": WORKER_PREP,
        "outputs_encode_us": "encode TokenOutputs",
    }
    summary: dict[str, float] = {}
    for key, names in parts.items():
        names = (names,) if isinstance(names, str) else names
        if not all(name in medians for name in names):
            return None
        summary[key] = sum(medians[name] for name in names)
    summary["target_measure_us"] = (
        summary["scheduler_us"] + summary["plan_codec_us"] + summary["result_codec_us"]
    )
    summary["full_host_us"] = (
        summary["target_measure_us"] + summary["worker_prep_us"] + summary["outputs_encode_us"]
    )
    return summary
