"""Shared by the benchmarks: the roofline measured in the same run, the bytes and FLOPs a model
step must move, tables, JSON, PNG plots and progress bars.

The roofline of a step is what the hardware allows: a decode step must read every weight once
and the KV cache of every context it attends to, so its floor is those bytes over the copy
bandwidth; a prefill step is bound by the larger of its FLOPs over the matrix rate and its
bytes over the bandwidth. Both rates are measured on the device of the run, not taken from a
datasheet, so that a figure and its floor come from the same machine in the same state.

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
from dataclasses import asdict, dataclass
from typing import Any

# ---------------------------------------------------------------------------------------------
# Devices and the measured roofline
# ---------------------------------------------------------------------------------------------

_DTYPE_NAMES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def measure_copy_bandwidth(device: Any, nbytes: int | None = None, repeats: int = 9) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus written.

    The buffer is far larger than any cache (1 GiB on a GPU, 128 MiB on the host), so this
    is the memory bandwidth a weight-streaming decode step can hope for. Median of repeats.
    """
    import torch

    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    seconds = statistics.median(time_op(lambda: dst.copy_(src), device, repeats))
    return 2 * nbytes / seconds


def measure_matmul_rate(device: Any, dtype: Any, n: int | None = None, repeats: int = 9) -> float:
    """FLOP/s of a large square matmul in ``dtype`` (2 n^3 FLOPs each), median of repeats."""
    import torch

    if n is None:
        n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = statistics.median(time_op(lambda: a @ b, device, repeats))
    return 2 * n**3 / seconds


def measure_host_to_device_bandwidth(device: Any, nbytes: int = 256 << 20) -> float:
    """Bytes per second from pageable host memory to ``device`` (a memcpy on the CPU)."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.float16)
    if device.type == "cuda":
        dst = torch.empty_like(src, device=device)
        times = time_op(lambda: dst.copy_(src), device, 5)
    else:
        dst = torch.empty_like(src)
        times = time_op(lambda: dst.copy_(src), device, 5)
    return nbytes / statistics.median(times)


@dataclass
class Roofline:
    """The two rates measured in this run, and the floors they give for a step."""

    device: str
    dtype: str
    copy_bytes_per_s: float  # bytes read + written per second
    matmul_flops_per_s: float

    def seconds(self, flops: float, nbytes: float) -> float:
        return max(flops / self.matmul_flops_per_s, nbytes / self.copy_bytes_per_s)

    def describe(self) -> str:
        return (
            f"roofline measured on {self.device} ({self.dtype}): copy "
            f"{self.copy_bytes_per_s / 1e9:.1f} GB/s (read + written), matmul "
            f"{self.matmul_flops_per_s / 1e12:.2f} TFLOP/s"
        )


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
# What a model step must move and compute
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    """The sizes that set a decoder-only transformer's bytes and FLOPs, from config.json."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    has_qk_norm: bool
    dtype_bytes: int

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one layer's projections (QKV, O, gate/up, down)."""
        h, d = self.hidden_size, self.head_dim
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * d
        out = self.num_heads * d * h
        mlp = 3 * h * self.intermediate_size
        return qkv + out + mlp

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        norms = self.num_layers * (
            2 * self.hidden_size + (2 * self.head_dim if self.has_qk_norm else 0)
        )
        embed = self.lm_head_params * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_matmul_params + norms + self.hidden_size + embed

    @property
    def decode_weight_bytes(self) -> int:
        """Weight bytes one step reads: all of them, except that an untied embedding table is
        only gathered row by row (a tied one is read in full as the LM head)."""
        params = self.num_params
        if not self.tie_word_embeddings:
            params -= self.lm_head_params
        return params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def decode_step_bytes(self, context_lens: Sequence[int]) -> int:
        """Weights once, plus the KV cache of every context attended (the new tokens' KV
        written is one token per sequence, counted too)."""
        kv_tokens = sum(context_lens) + len(context_lens)
        return self.decode_weight_bytes + kv_tokens * self.kv_bytes_per_token

    def attention_flops(self, query_len: int, context_len: int) -> float:
        """QK^T and PV for ``query_len`` new tokens at the end of ``context_len`` tokens,
        counting only the unmasked (causal) pairs."""
        first = context_len - query_len + 1
        pairs = query_len * (first + context_len) / 2
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * pairs

    def step_flops(self, query_lens: Sequence[int], context_lens: Sequence[int]) -> float:
        """A step where sequence i runs query_lens[i] tokens ending at context_lens[i]; the
        LM head runs once per sequence (only the last token samples)."""
        tokens = sum(query_lens)
        flops = 2.0 * self.num_layers * self.layer_matmul_params * tokens
        flops += 2.0 * self.lm_head_params * len(query_lens)
        for q, c in zip(query_lens, context_lens):
            flops += self.attention_flops(q, c)
        return flops

    def prefill_bytes(self, prompt_lens: Sequence[int]) -> int:
        """Weights once, the KV written, and activations in and out of each projection."""
        tokens = sum(prompt_lens)
        activations = (
            2
            * tokens
            * self.num_layers
            * (2 * self.hidden_size + self.intermediate_size)
            * self.dtype_bytes
        )
        return self.decode_weight_bytes + tokens * self.kv_bytes_per_token + activations


def load_model_shape(model_path: str, dtype_bytes: int | None = None) -> ModelShape:
    with open(os.path.join(model_path, "config.json")) as f:
        hf = json.load(f)
    if "text_config" in hf:
        hf = {**hf, **hf["text_config"]}
    if dtype_bytes is None:
        dtype_bytes = _DTYPE_NAMES.get(hf.get("torch_dtype") or hf.get("dtype") or "", 2)
    num_heads = hf["num_attention_heads"]
    architecture = (hf.get("architectures") or ["?"])[0]
    return ModelShape(
        architecture=architecture,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        vocab_size=hf["vocab_size"],
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        has_qk_norm=architecture.startswith("Qwen3"),
        dtype_bytes=dtype_bytes,
    )


def decode_roofline_s(shape: ModelShape, roof: Roofline, context_lens: Sequence[int]) -> float:
    """Floor of one decode step of these contexts (each sequence adds one token)."""
    flops = shape.step_flops([1] * len(context_lens), [c + 1 for c in context_lens])
    return roof.seconds(flops, shape.decode_step_bytes(context_lens))


def prefill_roofline_s(shape: ModelShape, roof: Roofline, prompt_lens: Sequence[int]) -> float:
    flops = shape.step_flops(list(prompt_lens), list(prompt_lens))
    return roof.seconds(flops, shape.prefill_bytes(prompt_lens))


def generation_roofline_s(
    shape: ModelShape, roof: Roofline, batch: int, input_len: int, output_len: int
) -> float:
    """Floor of a whole offline run: prefill every prompt, then ``output_len - 1`` decode
    steps of the full batch (the first token comes from the prefill)."""
    total = prefill_roofline_s(shape, roof, [input_len] * batch)
    for step in range(1, output_len):
        total += decode_roofline_s(shape, roof, [input_len + step - 1] * batch)
    return total


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
