"""A torch profiler summary of batch-1 decode steps (``bench_latency --profile``): the busiest
ops, and on CUDA each part's GPU time a step beside its floor (tools/step_profile.py)."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

from tools.bench_model import ModelShape, Roofline


def profile_decode_steps(
    run_steps: Callable[[Any], object],
    device_type: str,
    context: int,
    steps: int,
    in_flight: int,
    shape: ModelShape,
    roof: Roofline,
    out_dir: str,
) -> str:
    """Profile ``run_steps(profiler)``, which runs ``steps`` decode steps of one sequence from
    ``context`` tokens, ``in_flight`` at a time; print the summary and write it to
    ``out_dir/latency_profile.txt``."""
    from torch.profiler import ProfilerActivity, profile

    from tools.step_profile import summarize_profile

    activities = [ProfilerActivity.CPU]
    if device_type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    # The profiler's events are millions of tracked objects: with the collector on, full
    # collections walking them grow to most of a second and fall inside profiled steps.
    gc.disable()
    try:
        run_steps(prof)
    finally:
        gc.enable()
    averages = prof.key_averages()
    sort_key = "self_device_time_total" if device_type == "cuda" else "self_cpu_time_total"
    try:
        table = averages.table(sort_by=sort_key, row_limit=25, max_name_column_width=70)
    except (AttributeError, KeyError):
        table = averages.table(sort_by="self_cuda_time_total", row_limit=25)
    text = f"profile of {steps} decode steps at context {context}, {in_flight} in flight:\n{table}"
    if device_type == "cuda":
        _, parts = summarize_profile(
            prof,
            steps,
            shape,
            roof,
            [context + steps // 2],
            f"where a batch-1 decode step's GPU time goes, context {context}, {steps} steps",
        )
        text += "\n\n" + parts
    print("\n" + text, flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "latency_profile.txt"), "w") as f:
        f.write(text + "\n")
    return text
