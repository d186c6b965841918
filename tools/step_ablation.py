"""Parts of a decode step taken out, to see how long each holds a step up.

A profile charges each kernel its own time, but with PDL kernels overlap and wait on each
other, so a part's time there is not what the step would save without it. Here the part is
not run at all, and the step is timed as usual: the difference is what the step spends on
that part's critical path, an upper bound for fusing it away. The outputs are then not the
model's (the tokens are garbage), so this is for timing only.

``bench_latency --without PARTS`` and ``bench_throughput --engine inprocess --without PARTS``
take it. Parts, in decode steps only (prefills run whole, so the cache and the sequence are
real):
- ``attention``: decode attention returns q, which the o projection reads in its place;
- ``rotary``: q and k are not rotated or normed, and no key or value is written to the cache.

On an H100 (Qwen3-4B, batch 1, context 128) a step took 3.07 ms, 2.95 without attention and
2.89 without both (tools/MEASUREMENTS.md, thirty-sixth session).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

PARTS = ("attention", "rotary")


def parse_parts(spec: str) -> tuple[str, ...]:
    """``"attention,rotary"`` -> the parts, checked; ``""`` -> none."""
    parts = tuple(part.strip() for part in spec.split(",") if part.strip())
    unknown = sorted(set(parts).difference(PARTS))
    if unknown:
        raise ValueError(f"unknown step parts {', '.join(unknown)}: want {', '.join(PARTS)}")
    return parts


@contextmanager
def without(parts: Iterable[str]) -> Iterator[None]:
    """Inside the block, the model's decode steps skip ``parts``: build (and capture) the
    runner inside it, so that its graphs leave them out too."""
    import kernels
    from worker_proc.forward_context import get_forward_context

    parts = tuple(parts)
    saved = {name: getattr(kernels, name) for name in ("paged_attention", "rotary_and_store_kv")}

    def decoding() -> bool:
        return get_forward_context().max_query_len == 1

    def attention(q: Any, *args: Any, **kwargs: Any) -> Any:
        return q if decoding() else saved["paged_attention"](q, *args, **kwargs)

    def rotary(positions: Any, q: Any, *args: Any, **kwargs: Any) -> Any:
        return q if decoding() else saved["rotary_and_store_kv"](positions, q, *args, **kwargs)

    if "attention" in parts:
        kernels.paged_attention = attention
    if "rotary" in parts:
        kernels.rotary_and_store_kv = rotary
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(kernels, name, function)
