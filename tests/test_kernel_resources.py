"""tools/kernel_resources.py: a decode step's kernels compiled for sm_90 without a GPU, and
the programs-per-SM arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.kernel_resources import programs_per_sm

ROOT = Path(__file__).resolve().parents[1]


def test_programs_per_sm_names_the_binding_limit():
    # 255 registers a thread at 4 warps: 8,192 a warp, 32,768 a program.
    assert programs_per_sm(255, 1024, 4) == (2, "registers")
    # 80 KiB of shared memory (plus the 1 KiB each program reserves) out of 228 KiB.
    assert programs_per_sm(56, 80 * 1024, 4) == (2, "shared")
    # Registers are allocated per warp in units of 256: 37 a thread count as 40.
    assert programs_per_sm(37, 1024, 2) == (25, "registers")
    assert programs_per_sm(16, 0, 16) == (4, "warps")
    assert programs_per_sm(16, 0, 1) == (32, "programs")


def test_tool_compiles_every_kernel_of_a_one_row_step(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-m", "tools.kernel_resources", "--rows", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    kernels = json.loads((tmp_path / "kernel_resources.json").read_text())["kernels"]
    parts = [k["part"] for k in kernels]
    assert parts == [
        "qkv",
        "q/k norm + rotary + kv write",
        "decode attention",
        "o",
        "gate_up",
        "down",
        "lm_head",
    ]
    for kernel in kernels:
        assert 0 < kernel["registers"] <= 255, kernel
        assert 1 <= kernel["per_sm"] <= 32, kernel
        assert kernel["programs"] > 0, kernel
    by_part = {k["part"]: k for k in kernels}
    # Qwen3-4B at one row: 6,144 qkv features four a program, whose weight tiles read before
    # the wait still fit the GPU in one round; o's weight read early costs registers, not
    # shared memory (the GEMV has none but its reduction's scratch).
    assert by_part["qkv"]["programs"] == 1536
    assert by_part["qkv"]["rounds"] <= 1.0
    assert by_part["o"]["kernel"] == "_gemv_kernel"
    assert by_part["o"]["shared"] <= 2048
    assert "decode-step kernels, qwen3 4b" in result.stdout


def test_tool_refuses_the_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "tools.kernel_resources", "--rows", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "TRITON_INTERPRET" in result.stderr


SAMPLING_KERNELS = """
import torch
# Imported before Triton is loaded, as in the worker: a kernel that calls another module's
# jitted helper must reach it through that module, or it names the unbound function.
from kernels import argmax, sampling_candidates, sampling_race
from kernels.backend import load_triton
load_triton()
from tools.kernel_resources import Launch, compile_launch
V = 151936
rows = 8
common = dict(keys_ptr=torch.empty(rows, dtype=torch.int64),
              positions_ptr=torch.empty(rows, dtype=torch.int64),
              out_ptr=torch.empty(rows, dtype=torch.int64), call_key=12345)
race = dict(common, values_ptr=torch.empty(rows, V, dtype=torch.bfloat16),
            inv_temperature_ptr=torch.empty(rows), partial_score_ptr=torch.empty(rows * 38),
            partial_index_ptr=torch.empty(rows * 38, dtype=torch.int32),
            counters_ptr=torch.empty(rows, dtype=torch.int32), vocab=V, stride_row=V,
            num_chunks=38, CHUNK=4096, CHUNKS_PAD=64)
print(compile_launch(Launch(sampling_race._race_kernel, race, {"num_warps": 4}, rows), 90))
for top_p in (False, True):
    for min_p in (False, True):
        cand = dict(common, values_ptr=torch.empty(rows, 128),
                    ids_ptr=torch.empty(rows, 128, dtype=torch.int64),
                    top_k_ptr=torch.empty(rows, dtype=torch.int64), top_p_ptr=torch.empty(rows),
                    min_p_ptr=torch.empty(rows), width=128, WIDTH_PAD=128, TOP_P=top_p,
                    MIN_P=min_p)
        launch = Launch(sampling_candidates._candidates_kernel, cand, {"num_warps": 1}, rows)
        print(compile_launch(launch, 90))
"""


def compiled_resources(script: str) -> list[dict[str, int]]:
    """Runs a script that prints one ``compile_launch`` result a line (outside the
    interpreter, in a process of its own) and returns the results."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line.replace("'", '"')) for line in result.stdout.splitlines()]
    for resources in compiled:
        assert 0 < resources["registers"] <= 255, resources
    return compiled


def test_the_sampling_kernels_compile_for_sm_90():
    """The race and candidates kernels (run after the decode graph, so not in the step
    above) compile for sm_90 as the worker imports them."""
    assert len(compiled_resources(SAMPLING_KERNELS)) == 5


TOP_CANDIDATES = """
import torch
from kernels import top_candidates as tc
from kernels.backend import load_triton
load_triton()
from tools.kernel_resources import Launch, compile_launch
V, rows, chunks = 151936, 8, 19
for dtype in (torch.bfloat16, torch.float32):
    common = dict(values_ptr=torch.empty(rows, V, dtype=dtype), slot_values_ptr=torch.empty(rows, 1024),
                  slot_ids_ptr=torch.empty(rows, 1024, dtype=torch.int64),
                  counters_ptr=torch.empty(2 * rows, dtype=torch.int32), vocab=V, stride_row=V,
                  SLOTS=1024)
    group_max = dict(common, partial_ptr=torch.empty(rows * chunks * 256, dtype=dtype),
                     bound_ptr=torch.empty(rows), num_chunks=chunks, k=128, CHUNK=8192,
                     GROUPS=256, FILL=64)
    print(compile_launch(Launch(tc._group_max_kernel, group_max, {"num_warps": 4}, rows), 90))
    gather = dict(common, bound_ptr=torch.empty(rows), CHUNK=2048)
    print(compile_launch(Launch(tc._gather_kernel, gather, {"num_warps": 8}, rows), 90))
    for histogram in (True, False):
        redo = dict(common, k=128, EXACT_BLOCK=1024, HISTOGRAM=histogram)
        print(compile_launch(Launch(tc._redo_kernel, redo, {"num_warps": 8}, rows), 90))
    select = dict(slot_values_ptr=common["slot_values_ptr"], slot_ids_ptr=common["slot_ids_ptr"],
                  counters_ptr=common["counters_ptr"], top_ptr=torch.empty(rows, 128),
                  ids_ptr=torch.empty(rows, 128, dtype=torch.int64), k=128, SLOTS=1024)
    print(compile_launch(Launch(tc._select_kernel, select, {"num_warps": 4}, rows), 90))
"""


def test_the_top_candidates_kernels_compile_for_sm_90():
    """The four launches of the top candidates (the sorts, the atomics, both ways of counting
    in the exact redo) compile for sm_90, for the model's dtype and for float32 logits."""
    assert len(compiled_resources(TOP_CANDIDATES)) == 10
