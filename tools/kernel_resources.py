"""Registers, shared memory and programs per SM of a decode step's Triton kernels, without a GPU.

    python -m tools.kernel_resources [--preset 4b] [--rows 1,8,32] [--arch 90]

Runs the real kernel wrappers (``kernels.linear_add_residual_triton``, the skinny GEMM,
decode attention, rotary) at a Qwen3 shape on CPU tensors, catches each launch instead of
running it, and compiles that launch for the GPU architecture with the installed Triton and
its ptxas: the same constexprs, warps and stages, and the integer and pointer arguments
specialized the way Triton's JIT does (multiples of 16, the value 1). ``cuobjdump`` then gives
the registers a thread. The table shows how many programs of each kernel fit a SM and by
what limit, and how many rounds its grid takes on ``--sms`` SMs: what decides whether a
kernel's programs can sit beside another's (kernels/pdl.py). Figures are those of the
installed Triton; the device's may differ by a few registers.

Each shape takes the kernel and tile the engine picks: the GEMV at one and two rows; at 3-64
rows the skinny GEMM with the tile of ``--table`` (the H200 table by default), or cuBLAS,
which is left out.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tools.bench_common import parse_int_list, print_table, run_metadata, save_json

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 233472  # 228 KiB, of which each resident program reserves 1 KiB
MAX_PROGRAMS_PER_SM = 32
MAX_WARPS_PER_SM = 64
_TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}


@dataclass
class Launch:
    """One caught ``kernel[grid](...)``: the function, its arguments by name and the grid."""

    kernel: Any
    args: dict[str, Any]
    options: dict[str, Any]
    programs: int


@contextmanager
def caught_launches() -> Iterator[list[Launch]]:
    """Catch every Triton launch in the block instead of running it; the wrappers see PDL
    as available, as on a Hopper GPU."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def catch(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        names = self.arg_names
        bound = dict(zip(names, args))
        options = {k: v for k, v in kwargs.items() if k not in names}
        bound.update({k: v for k, v in kwargs.items() if k in names})
        for param in self.params:
            if param.name not in bound and param.has_default:
                bound[param.name] = param.default
        shape = grid(bound) if callable(grid) else grid
        programs = 1
        for extent in shape:
            programs *= int(extent)
        launches.append(Launch(self, bound, options, programs))

    # By module name: the package re-exports functions under some of these names.
    modules = [
        importlib.import_module(f"kernels.{name}")
        for name in (
            "decode_attention",
            "gemv",
            "linear_fused",
            "linear_fused_rows",
            "rotary",
            "skinny_gemm",
        )
    ]
    saved = [(module, module.use_pdl) for module in modules]
    original_run = JITFunction.run
    JITFunction.run = catch
    for module in modules:
        module.use_pdl = lambda tensor: True
    try:
        yield launches
    finally:
        JITFunction.run = original_run
        for module, use_pdl in saved:
            module.use_pdl = use_pdl


def _specialize(kernel: Any, args: dict[str, Any]) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and divisibility attributes for ``args``."""
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for index, param in enumerate(kernel.params):
        value = args[param.name]
        key = (index,)
        if param.is_constexpr or value is None or isinstance(value, str):
            signature[param.name] = "constexpr"
            constexprs[key] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0 and not param.do_not_specialize_on_alignment:
                attrs[key] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            if value == 1 and not param.do_not_specialize:
                signature[param.name] = "constexpr"
                constexprs[key] = 1
                continue
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[key] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot specialize {param.name}={value!r}")
    return signature, constexprs, attrs


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise SystemExit(f"no cuobjdump at {path}: this Triton has no NVIDIA backend binaries")
    return path


def compile_launch(launch: Launch, arch: int) -> dict[str, int]:
    """Compile one caught launch for ``sm_{arch}``: registers a thread, shared bytes a
    program, warps."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.compiler import ASTSource

    signature, constexprs, attrs = _specialize(launch.kernel, launch.args)
    source = ASTSource(launch.kernel, signature, constexprs=constexprs, attrs=attrs)
    fields = CUDAOptions.__dataclass_fields__
    options = {k: v for k, v in launch.options.items() if k in fields}
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [_cuobjdump(), "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    static_shared = int(re.search(r"SHARED:(\d+)", usage).group(1))
    return {
        "registers": registers,
        "shared": compiled.metadata.shared + static_shared,
        "warps": compiled.metadata.num_warps,
    }


def programs_per_sm(registers: int, shared: int, warps: int) -> tuple[int, str]:
    """Resident programs a SM holds, and the limit that decides it (Hopper's figures:
    registers allocated per warp in units of 256)."""
    per_warp = -(-registers * 32 // 256) * 256
    limits = {
        "registers": REGISTERS_PER_SM // (per_warp * warps),
        "shared": SHARED_PER_SM // (shared + 1024),
        "warps": MAX_WARPS_PER_SM // warps,
        "programs": MAX_PROGRAMS_PER_SM,
    }
    limit = min(limits, key=limits.get)
    return limits[limit], limit


def _empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def decode_step_launches(
    fields: dict[str, Any], rows: int, context: int, block_size: int = 16
) -> list[tuple[str, Launch]]:
    """One decoder layer's kernels and the LM head, at ``rows`` sequences of ``context``
    tokens, as a decode step launches them: ``(part, launch)`` in step order."""
    from kernels.decode_attention import paged_decode_attention_triton
    from kernels.linear import (
        AFTER_IDLE,
        AFTER_STREAM,
        linear_add_residual_triton,
        linear_triton,
    )
    from kernels.linear_configs import pick_config, skinny_config
    from kernels.linear_fused import linear_silu_and_mul_triton
    from kernels.linear_fused_rows import linear_silu_and_mul_rows, rows_fusion_tile
    from kernels.pending_norm import PendingNorm
    from kernels.rotary import rotary_and_store_kv_triton
    from kernels.skinny_gemm import skinny_gemm_with

    hidden, inter = fields["hidden_size"], fields["intermediate_size"]
    heads, kv_heads, head_dim = (
        fields["num_attention_heads"],
        fields["num_key_value_heads"],
        fields["head_dim"],
    )
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    eps = fields["rms_norm_eps"]
    blocks = rows * -(-context // block_size)
    caught: list[tuple[str, Launch]] = []

    def pending() -> PendingNorm:
        groups = _empty(rows, 40, dtype=torch.float32)
        return PendingNorm(_empty(rows, hidden), _empty(hidden), eps, groups, _empty(rows, hidden))

    def step(part: str, run: Callable[[], Any]) -> Any:
        before = len(launches)
        result = run()
        caught.extend((part, launch) for launch in launches[before:])
        return result

    def add_norm(part: str, x: torch.Tensor, n: int, prefetch: str) -> None:
        weight = _empty(n, x.shape[1])
        config = pick_config(rows, n, x.shape[1])
        if config is not None:
            step(
                part,
                lambda: linear_add_residual_triton(
                    x, weight, _empty(rows, n), _empty(n), config, prefetch
                ),
            )

    with caught_launches() as launches:
        qkv_weight = _empty(q_size + 2 * kv_size, hidden)
        if pick_config(rows, *qkv_weight.shape) is not None:
            qkv = step("qkv", lambda: linear_triton(pending(), qkv_weight, prefetch=AFTER_STREAM))
        else:
            qkv = _empty(rows, q_size + 2 * kv_size)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        k_cache = _empty(blocks + 1, block_size, kv_heads, head_dim)
        v_cache = _empty(blocks + 1, block_size, kv_heads, head_dim)
        cos = _empty(fields["max_position_embeddings"], head_dim // 2, dtype=torch.float32)
        q = step(
            "q/k norm + rotary + kv write",
            lambda: rotary_and_store_kv_triton(
                torch.zeros(rows, dtype=torch.int64),
                q.view(rows, heads, head_dim),
                k.view(rows, kv_heads, head_dim),
                v.view(rows, kv_heads, head_dim),
                cos,
                cos,
                k_cache,
                v_cache,
                torch.zeros(rows, dtype=torch.int64),
                (_empty(head_dim), _empty(head_dim), eps),
            ),
        )
        table = torch.zeros(rows, blocks // rows, dtype=torch.int32)
        attention = step(
            "decode attention",
            lambda: paged_decode_attention_triton(
                q,
                k_cache,
                v_cache,
                table,
                torch.full((rows,), context, dtype=torch.int32),
                head_dim**-0.5,
                max_context_len=context,
            ),
        )
        add_norm("o", attention.view(rows, q_size), hidden, prefetch=AFTER_IDLE)
        gate_up = _empty(2 * inter, hidden)
        if rows == 1:
            step("gate_up", lambda: linear_silu_and_mul_triton(pending(), gate_up))
        elif (rows_config := rows_fusion_tile(rows, inter * 2, hidden)) is not None:
            step("gate_up", lambda: linear_silu_and_mul_rows(pending(), gate_up, rows_config))
        elif (config := skinny_config(rows, inter * 2, hidden, True)) is not None:
            step(
                "gate_up",
                lambda: skinny_gemm_with(
                    pending().weighted, gate_up, None, config, silu_mul=True, normed=pending()
                ),
            )
        add_norm("down", _empty(rows, inter), hidden, prefetch=AFTER_STREAM)
        lm_head = _empty(fields["vocab_size"], hidden)
        if pick_config(rows, *lm_head.shape) is not None:
            step("lm_head", lambda: linear_triton(pending(), lm_head))
    return caught


def main(argv: list[str] | None = None) -> None:
    from kernels.backend import load_triton
    from kernels.linear_configs import table_path
    from tools.checkpoint_presets import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--preset", default="4b", help="a qwen3 shape: 0.6b, 1.7b, 4b, 8b, 14b, 32b"
    )
    parser.add_argument("--rows", type=parse_int_list, default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=1024, help="tokens of each sequence")
    parser.add_argument("--arch", type=int, default=90, help="compute capability, as 90")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--table", default=str(table_path("NVIDIA H200")))
    parser.add_argument("--out", default="bench_results")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    os.environ["PEGAINFER_LINEAR_TABLE"] = args.table
    load_triton()
    fields = PRESETS["qwen3"][args.preset]
    records: list[dict[str, Any]] = []
    for rows in args.rows:
        for part, launch in decode_step_launches(fields, rows, args.context):
            usage = compile_launch(launch, args.arch)
            fit, limit = programs_per_sm(usage["registers"], usage["shared"], usage["warps"])
            records.append(
                {
                    "rows": rows,
                    "part": part,
                    "kernel": launch.kernel.__name__,
                    **usage,
                    "programs": launch.programs,
                    "per_sm": fit,
                    "limited_by": limit,
                    "rounds": launch.programs / (fit * args.sms),
                }
            )
    print_table(
        f"decode-step kernels, qwen3 {args.preset}, context {args.context}, compiled for "
        f"sm_{args.arch} ({args.sms} SMs)",
        [
            "rows",
            "part",
            "kernel",
            "regs",
            "shared KB",
            "warps",
            "programs",
            "per SM",
            "by",
            "rounds",
        ],
        [
            (
                r["rows"],
                r["part"],
                r["kernel"],
                r["registers"],
                f"{r['shared'] / 1024:.1f}",
                r["warps"],
                r["programs"],
                r["per_sm"],
                r["limited_by"],
                f"{r['rounds']:.2f}",
            )
            for r in records
        ],
    )
    save_json(
        args.out,
        "kernel_resources",
        {"meta": run_metadata(argv), "args": vars(args), "kernels": records},
    )


if __name__ == "__main__":
    main()
