"""Every Triton kernel's dependencies resolve as the compiler will resolve them.

Triton's CPU interpreter runs kernels as plain Python, so a kernel that calls a helper kernel
imported by name from another module (which Triton cannot bind: only module attributes and
its own module's globals are rebound to their compiled functions) passes every CPU test and
fails on a GPU at its first launch. Computing each kernel's cache key walks its references
as compilation does; it needs Triton but no GPU, in a process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_test_util import requires_triton

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import importlib, pkgutil, sys
import kernels
from kernels.backend import load_triton
modules = [importlib.import_module(f"kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)]
load_triton()
checked, failed = 0, []
for module in modules:
    for name, obj in vars(module).items():
        if "JITFunction" in type(obj).__name__ and obj.fn.__module__ == module.__name__:
            checked += 1
            try:
                obj.cache_key
            except Exception as error:
                failed.append(f"{module.__name__}.{name}: {error}")
print(checked)
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


@requires_triton
def test_every_kernel_resolves_its_dependencies():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert int(result.stdout.split()[0]) > 50  # every kernel module was seen


# The mixture-of-experts kernels compiled for sm_90, and the grouped GEMM of every tile rule
# held to the shared memory a launch on an H100 or H200 checks (the float32 decode tile once
# needed 294,912 bytes there).
COMPILE = """
import json, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.backend import load_triton
load_triton()
import kernels.fused_moe as moe
import kernels.moe_tiles as moe_tiles

def shared(dtype, tiles, gated, norm_groups=0, early=False):
    block_m, block_n, block_k, warps = tiles
    sig = {"a_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}" if gated else "*fp32",
           "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
           "pair_weights_ptr": "*fp32", "square_sums_ptr": "*fp32", "num_pairs": "i32",
           "N": "i32", "K": "i32", "stride_a": "i32", "stride_we": "i32", "stride_wn": "i32",
           "stride_out": "i32", "num_norm_groups": "i32", "stride_sums": "i32", "eps": "fp32"}
    consts = dict(A_ROW_DIVISOR=8, NORM_GROUPS=norm_groups, GATED=gated, WEIGHTED=not gated, BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=block_k, FP32_DOT=False,
                  PRECISION="ieee" if dtype == "fp32" else "tf32", USE_PDL=True,
                  LAUNCH_SUCCESSOR=True, EARLY_TILE=early)
    sig.update(dict.fromkeys(consts, "constexpr"))
    kernel = triton.compile(ASTSource(moe._grouped_gemm_kernel, sig, consts),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 3})
    return kernel.metadata.shared

def compiles(fn, sig, consts, warps=4):
    sig = dict(sig, **dict.fromkeys(consts, "constexpr"))
    triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})

import kernels.moe_grouping as grouping
import kernels.moe_route_group as route_group
import kernels.moe_routing as routing
import kernels.moe_sum as moe_sum
pdl = dict(USE_PDL=True, LAUNCH_SUCCESSOR=True)
route = dict(NUM_EXPERTS=128, TOP_K=8, BLOCK_E=128, BLOCK_K=8, RENORMALIZE=True, **pdl)
i32 = "i32"
for chunk in (1, 16):
    compiles(routing._route_kernel, {"logits_ptr": "*bf16", "weights_ptr": "*fp32",
             "experts_ptr": "*i32", "num_tokens": i32, "stride_logits": i32},
             dict(route, TOKEN_CHUNK=chunk))
    compiles(route_group._route_group_kernel, {"logits_ptr": "*bf16", "weights_ptr": "*fp32",
             "experts_ptr": "*i32", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_padded_ptr": "*i32", "cursor_ptr": "*i32", "num_tokens": i32,
             "max_padded": i32, "stride_logits": i32},
             dict(route, TOKEN_CHUNK=chunk, BLOCK_M=16, CHUNK=64, CHUNK_PAIRS=512))
for tokens, pairs, blocks, warps in ((1, 8, 8, 1), (8, 64, 64, 4)):
    compiles(route_group._route_pairs_kernel, {"logits_ptr": "*bf16", "weights_ptr": "*fp32",
             "experts_ptr": "*i32", "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32",
             "num_padded_ptr": "*i32", "num_tokens": i32, "max_padded": i32,
             "stride_logits": i32},
             dict(route, BLOCK_T=tokens, BLOCK_P=pairs, BLOCK_M=16, BLOCK_BLOCKS=blocks,
                  TAIL_CHUNK=256), warps)
import kernels.moe_router_route as router_route
for tokens, pairs, blocks, warps, tile in ((1, 8, 8, 1, 2048), (8, 64, 64, 4, 1024)):
    compiles(router_route._router_route_kernel, {"x_ptr": "*bf16", "router_w_ptr": "*bf16",
             "in_sums_ptr": "*fp32", "logits_ptr": "*bf16", "counter_ptr": "*i32",
             "weights_ptr": "*fp32", "experts_ptr": "*i32", "sorted_pairs_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "num_tokens": i32,
             "max_padded": i32, "hidden": i32, "stride_x_row": i32, "stride_w_row": i32,
             "num_in_groups": i32, "eps": "fp32"},
             dict(route, NORMED=True, IN_GROUPS=32, TILE_K=tile, PREFETCH_TILES=2, BLOCK_T=tokens,
                  BLOCK_P=pairs, BLOCK_M=16, BLOCK_BLOCKS=blocks, TAIL_CHUNK=256,
                  W_EVICT="evict_first"), warps)
compiles(grouping._count_kernel, {"experts_ptr": "*i32", "counts_ptr": "*i32",
         "sorted_pairs_ptr": "*i32", "num_pairs": i32, "max_padded": i32},
         dict(NUM_EXPERTS=128, BLOCK_E=128, CHUNK_PAIRS=512, **pdl))
compiles(grouping._runs_kernel, {"counts_ptr": "*i32", "cursor_ptr": "*i32",
         "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "max_padded": i32},
         dict(NUM_EXPERTS=128, BLOCK_E=128, BLOCK_M=64, CHUNK=64, **pdl))
compiles(grouping._place_kernel, {"experts_ptr": "*i32", "cursor_ptr": "*i32",
         "sorted_pairs_ptr": "*i32", "num_pairs": i32}, dict(NUM_EXPERTS=128, CHUNK_PAIRS=512, **pdl))
compiles(moe_sum._sum_add_norm_kernel, {"per_pair_ptr": "*fp32", "residual_ptr": "*bf16",
         "weight_ptr": "*bf16", "normed_ptr": "*bf16", "new_residual_ptr": "*bf16",
         "num_tokens": i32, "hidden": i32, "eps": "fp32"}, dict(TOP_K=8, BLOCK_H=2048, **pdl))
compiles(moe_sum._sum_add_square_kernel, {"per_pair_ptr": "*fp32", "residual_ptr": "*bf16",
         "weight_ptr": "*bf16", "new_residual_ptr": "*bf16", "weighted_ptr": "*bf16",
         "square_sums_ptr": "*fp32", "num_tokens": i32, "hidden": i32},
         dict(TOP_K=8, BLOCK=256, **pdl))

rows = []
for dtype, size in (("bf16", 2), ("fp32", 4)):
    for tokens in (1, 64, 1000):
        tiles = moe_tiles.moe_tiles(tokens, size)
        down = max(shared(dtype, tiles, False), shared(dtype, tiles, False, early=True))
        rows.append([dtype, tokens, list(tiles), shared(dtype, tiles, True), down])
        if dtype == "bf16" and tokens <= 64:  # a pending norm's stream, in decode's 16-bit
            rows.append([dtype, tokens, list(tiles), shared(dtype, tiles, True, 64), 0])
print(json.dumps({"limit": moe_tiles.SHARED_MEMORY_BYTES, "rows": rows}))
"""


@requires_triton
def test_moe_kernels_compile_for_sm90_within_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    if result.returncode != 0 and "GPUTarget" in result.stderr:
        pytest.skip("this Triton cannot compile for CUDA without a GPU")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for dtype, tokens, tiles, gated, down in report["rows"]:
        assert max(gated, down) <= report["limit"], (dtype, tokens, tiles, gated, down)
