"""Time every Triton kernel against its PyTorch reference at Qwen3-4B shapes, and the
mixture-of-experts kernels at Qwen3-30B-A3B's (CUDA only).

    python -m tools.bench_kernels [--out bench_kernels.json | --out DIR] [--quick] [--match S]

Each row gives the median time (``triton.testing.do_bench``) of the Triton kernel and of the
reference, the bytes the operation must move at least, and the bandwidth that achieves,
beside the copy bandwidth measured in the same run (a large device-to-device copy, bytes
read plus written): the ratio is the kernel's share of the roofline. Prefill attention is
compute bound, so its row also gives TFLOP/s (causal pairs only).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tools.bench_moe_kernels import moe_cases

HIDDEN, INTERMEDIATE = 2560, 9728
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_SIZE = 16
VOCAB = 151_936
DTYPE = torch.bfloat16
ELEM = 2


def median_ms(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 29, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def paged_cache(contexts: list[int], device: torch.device):
    """A cache holding every context, blocks shuffled, plus its block tables."""
    blocks = [-(-c // BLOCK_SIZE) for c in contexts]
    total = sum(blocks) + 1
    physical = list(range(total))
    random.Random(0).shuffle(physical)
    shape = (total, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=DTYPE, device=device)
    v_cache = torch.randn(shape, dtype=DTYPE, device=device)
    width = max(blocks)
    tables, cursor = [], 0
    for count in blocks:
        row = physical[cursor : cursor + count]
        cursor += count
        tables.append(row + [0] * (width - count))
    block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return k_cache, v_cache, block_tables, context_lens


def cases(device: torch.device, quick: bool) -> list[tuple[str, Callable, Callable, int, float]]:
    """``(name, triton_fn, ref_fn, bytes, flops)`` per row."""
    from kernels import activation, attention, rmsnorm, rotary

    rows: list[tuple[str, Callable, Callable, int, float]] = []
    token_counts = [1, 64, 256] if quick else [1, 64, 256, 2048]
    for tokens in token_counts:
        x = torch.randn(tokens, HIDDEN, dtype=DTYPE, device=device)
        residual = torch.randn_like(x)
        weight = torch.randn(HIDDEN, dtype=DTYPE, device=device)
        size = x.numel() * ELEM
        rows.append(
            (
                f"rms_norm T={tokens}",
                lambda x=x, w=weight: rmsnorm.rms_norm_triton(x, w, 1e-6),
                lambda x=x, w=weight: rmsnorm.rms_norm_ref(x, w, 1e-6),
                2 * size + HIDDEN * ELEM,
                0.0,
            )
        )
        rows.append(
            (
                f"fused_add_rms_norm T={tokens}",
                lambda x=x, r=residual, w=weight: rmsnorm.fused_add_rms_norm_triton(x, r, w, 1e-6),
                lambda x=x, r=residual, w=weight: rmsnorm.fused_add_rms_norm_ref(x, r, w, 1e-6),
                4 * size + HIDDEN * ELEM,
                0.0,
            )
        )
        gate_up = torch.randn(tokens, 2 * INTERMEDIATE, dtype=DTYPE, device=device)
        rows.append(
            (
                f"silu_and_mul T={tokens}",
                lambda g=gate_up: activation.silu_and_mul_triton(g),
                lambda g=gate_up: activation.silu_and_mul_ref(g),
                3 * tokens * INTERMEDIATE * ELEM,
                0.0,
            )
        )
        qkv = torch.randn(
            tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=device
        )
        kv_width = NUM_KV_HEADS * HEAD_DIM
        q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, kv_width, kv_width], dim=-1)
        q = q.view(tokens, NUM_HEADS, HEAD_DIM)
        k = k.view(tokens, NUM_KV_HEADS, HEAD_DIM)
        v = v.view(tokens, NUM_KV_HEADS, HEAD_DIM)
        angles = torch.rand(40960, HEAD_DIM // 2, device=device)
        cos, sin = angles.cos(), angles.sin()
        positions = torch.randint(0, 40960, (tokens,), device=device)
        k_cache, v_cache, _, _ = paged_cache([tokens], device)
        slots = torch.randperm(k_cache.shape[0] * BLOCK_SIZE, device=device)[:tokens]
        # q, k, v read; q written, k and v written to the cache; a float32 cos/sin row.
        moved = 2 * qkv.numel() * ELEM + tokens * HEAD_DIM * 4
        rows.append(
            (
                f"rotary_and_store_kv T={tokens}",
                lambda a=(positions, q, k, v, cos, sin, k_cache, v_cache, slots): (
                    rotary.rotary_and_store_kv_triton(*a)
                ),
                lambda a=(positions, q, k, v, cos, sin, k_cache, v_cache, slots): (
                    rotary.rotary_and_store_kv_ref(*a)
                ),
                moved,
                0.0,
            )
        )

    scale = HEAD_DIM**-0.5
    batches = [1, 64] if quick else [1, 64, 256]
    for batch in batches:
        for context in (128, 4096):
            contexts = [context] * batch
            k_cache, v_cache, tables, lens = paged_cache(contexts, device)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
            qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
            args = (q, k_cache, v_cache, tables, lens, qsl, scale, 1, context)
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * ELEM
            rows.append(
                (
                    f"decode attention B={batch} ctx={context}",
                    lambda a=args: attention.paged_attention_triton(*a),
                    lambda a=args: attention.paged_attention_ref(*a),
                    kv_bytes + 2 * q.numel() * ELEM,
                    4.0 * batch * context * NUM_HEADS * HEAD_DIM,
                )
            )

    for prefix, length in ((0, 2048), (2048, 2048)):
        context = prefix + length
        k_cache, v_cache, tables, lens = paged_cache([context], device)
        q = torch.randn(length, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
        qsl = torch.tensor([0, length], dtype=torch.int32, device=device)
        args = (q, k_cache, v_cache, tables, lens, qsl, scale, length, context)
        pairs = length * prefix + length * (length + 1) // 2
        rows.append(
            (
                f"prefill attention {length} (prefix {prefix})",
                lambda a=args: attention.paged_attention_triton(*a),
                lambda a=args: attention.paged_attention_ref(*a),
                2 * context * NUM_KV_HEADS * HEAD_DIM * ELEM + 2 * q.numel() * ELEM,
                4.0 * pairs * NUM_HEADS * HEAD_DIM,
            )
        )

    from kernels import sampling_candidates, sampling_nucleus, sampling_race, top_candidates

    for batch in (1, 8, 64) if quick else (1, 8, 64, 256):
        logits = torch.randn(batch, VOCAB, dtype=DTYPE, device=device) * 3
        race_args = (
            logits,
            torch.full((batch,), 1.0 / 0.7, device=device),
            torch.full((batch,), -1, dtype=torch.int64, device=device),
            torch.arange(batch, device=device),
            12345,
        )
        rows.append(
            (
                f"sampling race B={batch}",
                lambda a=race_args: sampling_race.race_rows_triton(*a),
                lambda a=race_args: sampling_race.race_rows_ref(*a),
                logits.numel() * ELEM,
                0.0,
            )
        )
        rows.append(
            (
                f"top 128 candidates B={batch}",
                lambda x=logits: top_candidates.top_candidates_triton(x, 128),
                lambda x=logits: top_candidates.top_candidates_ref(x, 128),
                2 * logits.numel() * ELEM,
                0.0,
            )
        )
        values, ids = logits.float().topk(128, dim=-1)
        cut = torch.full((batch,), 0.95, device=device)
        candidate_args = (values, ids, torch.full_like(race_args[2], 20), cut, None,
                          race_args[2], race_args[3], 12345)  # fmt: skip
        rows.append(
            (
                f"sampling candidates (top-k 20, top-p) B={batch}",
                lambda a=candidate_args: sampling_candidates.race_candidates_triton(*a),
                lambda a=candidate_args: sampling_candidates.race_candidates_ref(*a),
                values.numel() * 12,
                0.0,
            )
        )
        nucleus_args = (logits, race_args[1], cut, torch.zeros_like(cut), *race_args[2:])
        rows.append(
            (
                f"sampling nucleus (top-p 0.95, no top-k) B={batch}",
                lambda a=nucleus_args: sampling_nucleus.race_nucleus_triton(*a),
                lambda a=nucleus_args: sampling_nucleus.race_nucleus_ref(*a),
                logits.numel() * ELEM,
                0.0,
            )
        )
    return rows + moe_cases(device, quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default="bench_kernels.json", help="a .json file, or a directory to write it in"
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--match", default="", help="only the rows whose name contains this")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU; the Triton kernels do not run on CPU here.")
        return 1
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device)
    name = torch.cuda.get_device_name(device)
    print(f"{name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write)")
    header = (
        f"{'kernel':<38}{'triton us':>11}{'ref us':>11}{'speedup':>9}"
        f"{'GB/s':>8}{'% copy':>8}{'TFLOP/s':>9}"
    )
    print(header)
    print("-" * len(header))
    results = []
    for row_name, triton_fn, ref_fn, moved, flops in cases(device, args.quick):
        if args.match not in row_name:
            continue
        triton_ms = median_ms(triton_fn)
        ref_ms = median_ms(ref_fn)
        achieved = moved / (triton_ms / 1e3)
        tflops = flops / (triton_ms / 1e3) / 1e12
        print(
            f"{row_name:<38}{triton_ms * 1e3:>11.1f}{ref_ms * 1e3:>11.1f}"
            f"{ref_ms / triton_ms:>8.1f}x{achieved / 1e9:>8.0f}{100 * achieved / copy_bw:>7.0f}%"
            f"{tflops:>9.1f}",
            flush=True,
        )
        results.append(
            {
                "kernel": row_name,
                "triton_ms": triton_ms,
                "ref_ms": ref_ms,
                "bytes": moved,
                "flops": flops,
                "achieved_gbps": achieved / 1e9,
                "percent_of_copy": 100 * achieved / copy_bw,
                "tflops": tflops,
            }
        )
    report = {
        "device": name,
        "copy_gbps": copy_bw / 1e9,
        "dtype": str(DTYPE).removeprefix("torch."),
        "shape": "Qwen3-4B",
        "rows": results,
    }
    out_path = Path(args.out)
    if out_path.suffix != ".json":  # a directory, as tools/gpu_checks.sh passes
        out_path.mkdir(parents=True, exist_ok=True)
        out_path = out_path / "bench_kernels.json"
    out_path.write_text(json.dumps(report, indent=2))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
