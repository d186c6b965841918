"""Vocabulary-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of the TP size and split into contiguous ranges,
one per rank. The embedding looks up the ids in its range and all-reduces (each token is
found on exactly one rank); the LM head computes its range of logits and all-gathers them.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from worker_proc.layers.linear import _check_shape
from worker_proc.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_rank = padded // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        # Padding rows are never looked up; zero them so their logits are finite anyway.
        self.weight = nn.Parameter(
            torch.zeros(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}: checkpoint has {loaded_weight.shape[0]} rows, "
                f"config says vocab_size={self.num_embeddings}"
            )
        end = min(self.vocab_end, self.num_embeddings)
        loaded = loaded_weight[self.vocab_start : end]
        target = param.data[: end - self.vocab_start]
        _check_shape(target, loaded, type(self).__name__)
        target.copy_(loaded)

    def embed_and_norm(
        self, input_ids: torch.Tensor, norm_weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(embedding), embedding)``: on one rank in one kernel, the first layer's
        input norm taken as the rows are looked up."""
        if self.tp_size == 1:
            return kernels.embed_rms_norm(input_ids, self.weight, norm_weight, eps)
        embedded = self(input_ids)
        return kernels.rms_norm(embedded, norm_weight, eps), embedded

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return kernels.embedding(input_ids, self.weight)
        # Ids outside this rank's range come back as zeros; the all-reduce fills them in.
        out = kernels.embedding(input_ids, self.weight, self.vocab_start)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection to vocabulary logits; may share its weight with the embedding."""

    def tie_weights(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError("tied LM head and embedding differ in shape")
        self.weight = embedding.weight

    def compute_logits(
        self, hidden_states: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab_size]`` in the model dtype, on every rank; written into
        ``out [N, vocab_size]`` when given (by the projection itself on one rank: a decode
        graph's logits buffer then costs no copy)."""
        if out is not None and self.tp_size == 1:
            return kernels.linear(hidden_states, self.weight, out=out)
        logits = tensor_model_parallel_all_gather(kernels.linear(hidden_states, self.weight))
        logits = logits[..., : self.num_embeddings]
        return logits if out is None else out.copy_(logits)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
