"""Scheduler counters, for metrics and the periodic log line."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    """Counters for metrics and the periodic log line."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks owned by requests
    num_free_blocks: int
    num_preemptions: int  # total since start
    prompt_tokens_total: int  # prompt tokens of requests that produced a first token
    generation_tokens_total: int
    num_steps_in_flight: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, in total
    prefix_cache_hits: int = 0  # of those, tokens found
    prompt_tokens_computed: int = 0  # prompt tokens prefilled (recomputation included)
    num_cached_blocks: int = 0  # unreferenced blocks kept for the prefix cache
