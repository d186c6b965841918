"""The worker process: one per tensor-parallel rank; owns weights, KV cache and sampling."""
