"""Mixture-of-experts routing: each token's top-k experts and their weights.

Routing is a softmax over the router's logits, the ``top_k`` largest probabilities, and
(``renormalize``) those divided by their sum. It runs on the device without a host
synchronisation and with shapes fixed by the token count alone, so a decode step keeps it
inside its CUDA graph.

A sparse layer's step routes and groups its pairs in one kernel at decode batches
(kernels/moe_route_group.py); above, the routing kernel here (a program to 16 tokens) and the
grouping's own kernels run. All route through ``route_tokens``.
"""

from __future__ import annotations

import torch

from kernels import pdl
from kernels.backend import cdiv, load_triton, next_power_of_2, triton_jit, use_pdl, use_triton

tl = None  # bound to triton.language by kernels.backend.load_triton()


# --- routing -------------------------------------------------------------------------


def moe_route_ref(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> (``[T, top_k]`` float32 weights, ``[T, top_k]`` int32 experts),
    the likeliest expert first."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts.to(torch.int32)


@triton_jit
def route_tokens(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    t0,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKEN_CHUNK: tl.constexpr,
    LOGITS_CACHE: tl.constexpr,
):
    """Route tokens ``t0 .. t0 + TOKEN_CHUNK`` and store their weights and experts: the
    experts fit one tile a token, and top-k is k rounds of one arg-max each. The logits are
    loaded with ``LOGITS_CACHE`` (``".cg"`` where other programs of the kernel wrote them)."""
    expert_ids = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    tokens = t0 + tl.arange(0, TOKEN_CHUNK)
    token_ok = tokens < num_tokens
    logits = tl.load(
        logits_ptr + tokens.to(tl.int64)[:, None] * stride_logits + expert_ids[None, :],
        mask=token_ok[:, None] & (expert_ids[None, :] < NUM_EXPERTS),
        other=float("-inf"),
        cache_modifier=LOGITS_CACHE,
    ).to(tl.float32)
    # Rows past the last token route something harmless, never stored.
    logits = tl.where(token_ok[:, None], logits, 0.0)
    exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    probs = exps / tl.sum(exps, axis=1)[:, None]
    # A row of NaN (a padding row of a graph, say) would match no expert: it gets the first
    # ones at weight 0 instead, so every expert id stays in range.
    probs = tl.where(probs == probs, probs, 0.0)
    # One key a candidate: a probability's bits (never negative, so they order as it does)
    # above the expert's distance from the last, so that the largest key is the likeliest
    # expert and, among equal probabilities, the lowest, as a stable top-k picks.
    keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - expert_ids)
    keys = tl.where(expert_ids[None, :] < NUM_EXPERTS, keys, -1)
    chosen = tl.zeros([TOKEN_CHUNK, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)
        chosen = tl.where(slots[None, :] == j, best[:, None], chosen)
        keys = tl.where(keys == best[:, None], -1, keys)
    chosen_experts = BLOCK_E - 1 - (chosen & 0xFFFFFFFF).to(tl.int32)
    chosen_weights = (chosen >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    if RENORMALIZE:
        # Slots past TOP_K hold 0.
        total = tl.maximum(tl.sum(chosen_weights, axis=1), 1e-30)  # 0 for NaN rows
        chosen_weights = chosen_weights / total[:, None]
    at = tokens[:, None] * TOP_K + slots[None, :]
    keep = token_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + at, chosen_weights, mask=keep)
    tl.store(experts_ptr + at, chosen_experts, mask=keep)


@triton_jit(do_not_specialize=("num_tokens",))
def _route_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TOKEN_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
    LAUNCH_SUCCESSOR: tl.constexpr,
):
    pdl.wait_for_inputs(USE_PDL, LAUNCH_SUCCESSOR)
    route_tokens(
        logits_ptr,
        weights_ptr,
        experts_ptr,
        tl.program_id(0) * TOKEN_CHUNK,
        num_tokens,
        stride_logits,
        NUM_EXPERTS,
        TOP_K,
        BLOCK_E,
        BLOCK_K,
        RENORMALIZE,
        TOKEN_CHUNK,
        "",
    )


def token_chunk(num_tokens: int, block_e: int) -> int:
    """Tokens a routing pass takes: one for a batch-1 decode step (not a [16, E] tile of 15
    empty rows); every other count shares one size, so that none compiles a variant of its
    own."""
    return 1 if num_tokens == 1 else max(1, min(16, 2048 // block_e))


def moe_route_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    experts = torch.empty((num_tokens, top_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, experts
    load_triton()
    with_pdl = use_pdl(router_logits)
    block_e = next_power_of_2(num_experts)
    chunk = token_chunk(num_tokens, block_e)
    _route_kernel[(cdiv(num_tokens, chunk),)](
        router_logits,
        weights,
        experts,
        num_tokens,
        router_logits.stride(0),
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        TOKEN_CHUNK=chunk,
        USE_PDL=with_pdl,
        LAUNCH_SUCCESSOR=pdl.launch_successor(with_pdl, "moe_route"),
        num_warps=4,
        **pdl.launch_options(with_pdl),
    )
    return weights, experts


def moe_route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if top_k > router_logits.shape[-1]:
        raise ValueError(f"top_k {top_k} exceeds the {router_logits.shape[-1]} experts")
    if use_triton(router_logits):
        return moe_route_triton(router_logits, top_k, renormalize)
    return moe_route_ref(router_logits, top_k, renormalize)
