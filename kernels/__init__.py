"""Kernels: each a plain PyTorch reference beside the dispatch function the models call."""

from kernels.activation import silu_and_mul
from kernels.argmax import argmax_rows
from kernels.attention import paged_attention, store_kv
from kernels.backend import use_triton
from kernels.embedding import embedding
from kernels.linear import linear
from kernels.linear_fused import linear_silu_and_mul
from kernels.linear_norm import linear_add_rms_norm
from kernels.pending_norm import PendingNorm, as_tensor
from kernels.prefill_work import prefill_queries_per_tile, prefill_work_table
from kernels.rmsnorm import embed_rms_norm, fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_and_store_kv, rotary_embedding
from kernels.sparse_mlp import moe_layer_add_rms_norm, moe_mlp, moe_mlp_add_rms_norm
from kernels.token_bitmask import apply_token_bitmask

__all__ = [
    "PendingNorm",
    "apply_token_bitmask",
    "argmax_rows",
    "as_tensor",
    "embed_rms_norm",
    "embedding",
    "fused_add_rms_norm",
    "linear",
    "linear_add_rms_norm",
    "linear_silu_and_mul",
    "moe_layer_add_rms_norm",
    "moe_mlp",
    "moe_mlp_add_rms_norm",
    "paged_attention",
    "prefill_queries_per_tile",
    "prefill_work_table",
    "rms_norm",
    "rotary_and_store_kv",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv",
    "use_triton",
]
