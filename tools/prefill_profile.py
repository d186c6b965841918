"""Where a prefill step's GPU time goes: the kernels of prefill-only steps grouped into the parts
of a step (tools/step_profile.py) and set beside each part's floor.

A prefill is bound by FLOPs where a decode step is bound by bytes. So here each projection's
floor is the larger of its FLOPs over the matmul rate and its bytes (weights, activations in
and out) over the copy bandwidth; prefill attention's is its causal FLOPs (QK^T and PV over
the unmasked pairs) over the matmul rate; the LM head's (a few last tokens) its weight's
bytes; and the elementwise kernels' (the norms, q/k norm + rotary + the KV write, SiLU-and-mul)
the bytes they must read and write. The projections are cuBLAS GEMMs at these token counts,
named by their place in the step as in a decode step.

``profile_prefill`` in tools/bench_inprocess.py makes the window: a batch of prompts each
asking for one token, so that every step of it is a prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tools.bench_model import ModelShape, Roofline
from tools.step_profile import LM_HEAD, breakdown, device_kernels, format_breakdown


def prefill_floors_us(
    shape: ModelShape, roof: Roofline, prompt_lens: Sequence[int], steps: int
) -> dict[str, float]:
    """Each part's floor, microseconds a step, for ``prompt_lens`` prefilled over ``steps``
    steps (no prompt shares a prefix with the cache); every step reads the weights once."""
    h, d, layers, dtype = shape.hidden_size, shape.head_dim, shape.num_layers, shape.dtype_bytes
    inter, heads, kv_heads = shape.intermediate_size, shape.num_heads, shape.num_kv_heads
    tokens = sum(prompt_lens) / steps  # a step's
    qkv_width = (heads + 2 * kv_heads) * d
    # (input features, output features) of each projection
    projections = {
        "qkv": (h, qkv_width),
        "o": (heads * d, h),
        "gate_up": (h, 2 * inter),
        "down": (inter, h),
    }
    floors = {}
    for name, (fan_in, fan_out) in projections.items():
        flops = 2.0 * tokens * fan_in * fan_out * layers
        nbytes = (fan_in * fan_out + tokens * (fan_in + fan_out)) * dtype * layers
        floors[name] = roof.seconds(flops, nbytes)
    last_tokens = len(prompt_lens) / steps
    floors[LM_HEAD] = roof.seconds(
        2.0 * last_tokens * shape.lm_head_params, shape.lm_head_params * dtype
    )
    attention = sum(shape.attention_flops(n, n) for n in prompt_lens) / steps
    floors["prefill attention"] = attention / roof.matmul_flops_per_s
    elementwise = {
        # two norms a layer, each reading the stream and the residual and writing both
        "add + rmsnorm": 2 * 4 * h,
        # q, k, v read; q, k, v written (k and v into the cache)
        "q/k norm + rotary + kv write": 2 * qkv_width,
        # gate and up read, their product written
        "silu x mul": 3 * inter,
    }
    for name, per_token in elementwise.items():
        floors[name] = tokens * per_token * dtype * layers / roof.copy_bytes_per_s
    return {name: seconds * 1e6 for name, seconds in floors.items()}


def summarize_prefill(
    prof: Any,
    steps: int,
    shape: ModelShape,
    roof: Roofline | None,
    prompt_lens: Sequence[int],
    title: str,
) -> tuple[dict[str, Any], str]:
    """The breakdown of a finished profiler's window of ``steps`` prefill-only steps over
    ``prompt_lens``, and its table."""
    floors = prefill_floors_us(shape, roof, prompt_lens, steps) if roof is not None else {}
    result = breakdown(device_kernels(prof), steps, shape, floors=floors)
    result.pop("between_steps", None)  # a decode step's stretch; a prefill's is not timed here
    return result, format_breakdown(title, result, shape.num_layers)
