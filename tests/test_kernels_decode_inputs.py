"""The decode graph's input loader against its torch reference: padded rows, pending tokens
from the device, block table rows narrower than the static buffer, no pending rows."""

from __future__ import annotations

import pytest
import torch
from triton_test_util import DEVICE, SEED, gen, requires_triton

from kernels.decode_inputs import (
    load_decode_inputs,
    load_decode_inputs_ref,
    load_decode_inputs_triton,
)

pytestmark = requires_triton


def _case(rows: int, num_pending: int, width: int, g: torch.Generator):
    def ints(*shape, high=1000, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=g, dtype=dtype).to(DEVICE)

    capacity, max_blocks = max(40, rows), max(24, width + 5)
    src = (ints(rows), ints(rows), ints(rows), ints(rows, dtype=torch.int32))
    slot_tables = ints(capacity + 1, max_blocks, high=5000, dtype=torch.int32)
    row_slots = ints(rows, high=capacity + 1)
    last_token = ints(capacity + 1, high=150000)
    pending_index = torch.randperm(rows, generator=g)[:num_pending].to(DEVICE)
    pending_slot = ints(num_pending, high=capacity + 1)

    def static():
        # Stale values everywhere, a wider block table buffer than the columns filled.
        dst = tuple(torch.full_like(t, -7) for t in src)
        tables = torch.full((rows, max_blocks), -7, dtype=torch.int32, device=DEVICE)
        return dst, tables

    rest = (slot_tables, row_slots, last_token, pending_index, pending_slot)
    return src, static, width, rest


@pytest.mark.parametrize(
    "rows, num_pending, width",
    # The last two take more than one round of the loops' fixed chunks (ROWS_BLOCK,
    # WIDTH_BLOCK): rows and pending tokens, then block table columns.
    [(1, 1, 1), (8, 5, 3), (13, 0, 24), (40, 40, 9), (300, 270, 5), (3, 1, 600)],
)
def test_loader_matches_reference(rows, num_pending, width):
    src, static, width, rest = _case(rows, num_pending, width, gen(rows + width))
    (want, want_tables), (got, got_tables) = static(), static()
    load_decode_inputs_ref(want, src, want_tables[:, :width], *rest)
    load_decode_inputs_triton(got, src, got_tables[:, :width], *rest)
    for name, a, b in zip(("ids", "positions", "slots", "context"), got, want):
        assert torch.equal(a, b), f"{name} (seed {SEED})"
    assert torch.equal(got_tables, want_tables), f"block tables (seed {SEED})"
    assert (got_tables[:, width:] == -7).all()  # columns past the step's longest context
    slot_tables, row_slots, last_token, pending_index, pending_slot = rest
    assert torch.equal(got_tables[:, :width], slot_tables[row_slots][:, :width])
    if num_pending:
        assert torch.equal(got[0][pending_index], last_token[pending_slot])


def test_dispatch_checks_its_arrays():
    src, static, width, rest = _case(4, 2, 5, gen(99))
    dst, tables = static()
    load_decode_inputs(dst, src, tables[:, :width], *rest)  # the reference on the CPU
    with pytest.raises(ValueError, match="context lengths"):
        load_decode_inputs(dst[:3], src, tables, *rest)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (real compiles)")
def test_one_compiled_variant_serves_every_batch_and_width(monkeypatch):
    """A variant per power of two of the rows or the width compiled inside the step that first
    needed it (kernels/compile_watch.py names such compiles)."""
    from kernels import compile_watch
    from kernels.backend import load_triton

    runtime = load_triton().knobs.runtime
    hooks = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    monkeypatch.setattr(compile_watch, "_watch", None)
    shapes = [(1, 1, 1), (40, 3, 17), (300, 270, 600), (7, 0, 129)]
    src, static, width, rest = _case(*shapes[0], gen(5))
    dst, tables = static()
    load_decode_inputs_triton(dst, src, tables[:, :width], *rest)  # compiled here, if at all
    try:
        watch = compile_watch.watch_late_compiles("test")
        for rows, num_pending, width in shapes[1:]:
            src, static, width, rest = _case(rows, num_pending, width, gen(rows))
            dst, tables = static()
            load_decode_inputs_triton(dst, src, tables[:, :width], *rest)
        torch.cuda.synchronize()
    finally:
        runtime.jit_cache_hook, runtime.jit_post_compile_hook = hooks
    assert watch.compiles == []
