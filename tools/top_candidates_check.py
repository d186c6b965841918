"""Which launch of the top candidates faults on rows that overflow their slots.

Each case (redo mode, dtype, row count) runs in its own process with CUDA_LAUNCH_BLOCKING=1,
so a fault names its launch (the traceback's line in kernels/top_candidates.py) and does not
poison the next case; with ``--sanitizer`` each runs under compute-sanitizer's memcheck.
Rows of three values overflow through ties; random rows with the slots cut to k overflow
with distinct values. GPU only.

    python -m tools.top_candidates_check [--sanitizer] [--rows 1,2,4,8,64]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

CASE = """
import torch
import kernels.top_candidates as tc
tc.REDO_BY_HISTOGRAM = {histogram}
V, K, rows = 151936, 128, {rows}
dev = torch.device("cuda")
torch.manual_seed(0)
ties = torch.randint(0, 3, (rows, V), device=dev).to(torch.{dtype})
top, _ = tc.top_candidates_triton(ties, K)
torch.cuda.synchronize()
ok_ties = torch.equal(top, ties.topk(K, dim=-1)[0].float())
distinct = (torch.randn(rows, V, device=dev) * 3).to(torch.{dtype})
top, _ = tc.top_candidates_triton(distinct, K, slots=K)
torch.cuda.synchronize()
ok_distinct = torch.equal(top, distinct.topk(K, dim=-1)[0].float())
print("ties", ok_ties, "distinct", ok_distinct)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,64")
    parser.add_argument("--sanitizer", action="store_true", help="run under compute-sanitizer")
    args = parser.parse_args(argv)
    prefix: list[str] = []
    if args.sanitizer:
        tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        if not os.path.exists(tool):
            print("compute-sanitizer not found")
            return 1
        prefix = [tool, "--tool", "memcheck", "--print-limit", "5"]
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    for histogram in (True, False):
        for dtype in ("bfloat16", "float32"):
            for rows in (int(r) for r in args.rows.split(",")):
                code = CASE.format(histogram=histogram, dtype=dtype, rows=rows)
                done = subprocess.run(
                    [*prefix, sys.executable, "-c", code],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=600,
                )
                lines = (done.stdout + done.stderr).splitlines()
                where = [line.strip() for line in lines if "top_candidates.py" in line][-2:]
                errors = [line.strip() for line in lines if "rror" in line][-3:]
                print(
                    f"histogram={histogram} {dtype} rows {rows}: rc {done.returncode} "
                    f"{done.stdout.strip()[-60:]} {where} {errors}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
