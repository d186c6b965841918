"""HF transformers' greedy `generate`, the reference the golden tests hold our tokens to."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``max_new_tokens`` greedy tokens after ``prompt_ids``, end-of-sequence ignored."""
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
