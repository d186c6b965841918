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

    capacity, max_blocks = 40, 24
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
    "rows, num_pending, width", [(1, 1, 1), (8, 5, 3), (13, 0, 24), (40, 40, 9)]
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
