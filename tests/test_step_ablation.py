"""tools/step_ablation.py: which calls a decode step leaves out, and that everything else
still runs the real kernels."""

from __future__ import annotations

import pytest
import torch

import kernels
from tools.step_ablation import PARTS, parse_parts, without
from worker_proc.forward_context import ForwardContext, set_forward_context


def _context(max_query_len: int) -> ForwardContext:
    none = torch.zeros(1, dtype=torch.int32)
    return ForwardContext(none, none, none, none, none, max_query_len, 8, 1, max_query_len)


def test_parts_are_parsed_and_checked():
    assert parse_parts("") == ()
    assert parse_parts(" attention , rotary ") == PARTS
    with pytest.raises(ValueError, match="unknown step parts o, qkv"):
        parse_parts("attention,qkv,o")


def test_decode_steps_skip_the_parts_and_prefills_run_them(monkeypatch):
    calls: list[str] = []

    def real_attention(q, *args, **kwargs):
        calls.append("attention")
        return q + 1

    def real_rotary(positions, q, *args, **kwargs):
        calls.append("rotary")
        return q + 2

    monkeypatch.setattr(kernels, "paged_attention", real_attention)
    monkeypatch.setattr(kernels, "rotary_and_store_kv", real_rotary)
    q = torch.zeros(3)
    with without(["attention"]):
        assert kernels.rotary_and_store_kv is real_rotary  # not asked for: untouched
        with set_forward_context(_context(1)):
            assert kernels.paged_attention(q) is q
        with set_forward_context(_context(4)):
            assert torch.equal(kernels.paged_attention(q), q + 1)
    assert kernels.paged_attention is real_attention
    with without(PARTS), set_forward_context(_context(1)):
        assert kernels.rotary_and_store_kv(None, q) is q
        assert kernels.paged_attention(q) is q
    assert calls == ["attention"]
    assert kernels.rotary_and_store_kv is real_rotary and kernels.paged_attention is real_attention
