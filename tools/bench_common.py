"""Shared by the benchmarks: the roofline rates measured in the same run, statistics, tables,
JSON, PNG plots and progress bars.

The two rates are measured on the device of the run, not taken from a datasheet, so that a
figure and its floor come from the same machine in the same state: the copy bandwidth of a
large device-to-device copy (bytes read + written) and the rate of a large matmul. What a
step must move and compute, and the floors that gives, are in ``tools.bench_model`` (its
names are re-exported here).

torch is imported lazily: bench_serving only needs it when it measures a roofline.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from typing import Any

from tools.bench_model import (  # noqa: F401  (re-exported: the floors beside the rates)
    ModelShape,
    Roofline,
    decode_roofline_s,
    generation_roofline_s,
    load_model_shape,
    prefill_roofline_s,
)

# ---------------------------------------------------------------------------------------------
# Devices and the measured roofline
# ---------------------------------------------------------------------------------------------


def resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str, device: Any) -> Any:
    import torch

    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_op(fn: Callable[[], Any], device: Any, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn``, each timed alone after a sync."""
    import torch

    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return times


# A GPU fresh from idle runs its first large copies slower: on one H200 a served sweep
# measured 4.00 TB/s as its first GPU work (two copies of warm-up, the median of nine) and a
# latency run on the same machine 4.12 TB/s a minute later, so the same steps came to 1.29 and
# 1.33 times their rooflines. The copy measurement now runs copies this long first.
WARMUP_SECONDS = 0.5


def warm_up(fn: Callable[[], Any], device: Any, seconds: float) -> None:
    """Call ``fn`` until ``seconds`` have passed (on a GPU; the host needs no warming)."""
    if device.type != "cuda":
        return
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(4):
            fn()
        synchronize(device)


def measure_copy_bandwidth(device: Any, nbytes: int | None = None, repeats: int = 9) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written.

    The buffer is far larger than any cache (1 GiB on a GPU, 128 MiB on the host), so this
    is the memory bandwidth a weight-streaming decode step can hope for. The fastest of
    ``repeats`` after ``WARMUP_SECONDS`` of copies: a roofline is what the machine can do.
    """
    import torch

    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    warm_up(lambda: dst.copy_(src), device, WARMUP_SECONDS)
    seconds = min(time_op(lambda: dst.copy_(src), device, repeats))
    return 2 * nbytes / seconds


def measure_matmul_rate(device: Any, dtype: Any, n: int | None = None, repeats: int = 9) -> float:
    """FLOP/s of a large square matmul in ``dtype`` (2 n^3 FLOPs each), the fastest of
    ``repeats`` after two. Not warmed up longer: after half a second of matmuls an H200 ran
    them at 653-665 TFLOP/s, against 733-787 measured fresh on other machines (most likely
    its power limit lowering the clocks; not traced)."""
    import torch

    if n is None:
        n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = min(time_op(lambda: a @ b, device, repeats))
    return 2 * n**3 / seconds


def measure_host_to_device_bandwidth(
    device: Any, nbytes: int = 256 << 20, pinned: bool = False
) -> float:
    """Bytes per second from host memory to ``device``: pageable memory (the driver stages
    it), or page-locked memory (``pinned``: a DMA, on CUDA only) as the worker's loader
    uses; on the CPU, a memcpy."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.float16)
    if pinned and device.type == "cuda":
        src = src.pin_memory()
    if device.type == "cuda":
        dst = torch.empty_like(src, device=device)
        times = time_op(lambda: dst.copy_(src), device, 5)
    else:
        dst = torch.empty_like(src)
        times = time_op(lambda: dst.copy_(src), device, 5)
    return nbytes / statistics.median(times)


def measure_roofline(device: Any, dtype: Any) -> Roofline:
    import torch

    copy = measure_copy_bandwidth(device)
    matmul = measure_matmul_rate(device, dtype)
    if device.type == "cuda":
        # Give the buffers back, so that a server started next profiles a free GPU.
        torch.cuda.empty_cache()
    return Roofline(device_description(device), dtype_name(dtype), copy, matmul)


def device_description(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return f"cpu ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


# ---------------------------------------------------------------------------------------------
# Statistics, tables, JSON, plots, progress
# ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean, p50, p90, p99 of ``values`` times ``scale`` (e.g. 1e3 for seconds to ms)."""
    scaled = [v * scale for v in values]
    return {
        "mean": statistics.fmean(scaled) if scaled else math.nan,
        "p50": percentile(scaled, 50),
        "p90": percentile(scaled, 90),
        "p99": percentile(scaled, 99),
    }


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:,.{digits}f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def format_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    line = "  ".join("-" * w for w in widths)
    out = [title, "  ".join(c.rjust(w) for c, w in zip(columns, widths)), line]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    text = format_table(title, columns, rows)
    print("\n" + text, flush=True)
    return text


def run_metadata(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how a result was made, saved beside it."""
    info: dict[str, Any] = {
        "command": " ".join(argv if argv is not None else sys.argv),
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        commit = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        info["commit"] = commit or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def to_jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def save_json(out_dir: str, name: str, payload: dict[str, Any]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(to_jsonable(payload), f, indent=2)
        f.write("\n")
    print(f"wrote {path}", flush=True)
    return path


def save_plot(
    out_dir: str,
    name: str,
    draw: Callable[[Any], None],
    title: str,
    ncols: int = 1,
) -> str:
    """Draw ``ncols`` side-by-side axes with ``draw(axes_list)`` and save a PNG (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, axes = plt.subplots(1, ncols, figsize=(6 * ncols, 4.2), squeeze=False)
    draw(list(axes[0]))
    fig.suptitle(title)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", flush=True)
    return path


def progress(total: int, desc: str, unit: str = "it") -> Any:
    """A tqdm bar on stderr; quiet when stderr is not a terminal unless PEGAINFER_PROGRESS=1."""
    from tqdm import tqdm

    forced = os.environ.get("PEGAINFER_PROGRESS") == "1"
    disable = not forced and not sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, disable=disable, leave=False, dynamic_ncols=True)


def parse_int_list(text: str) -> list[int]:
    values = [int(part) for part in text.replace(",", " ").split()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else math.nan
