"""Scheduler counters, for metrics and the periodic log line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_proc.scheduler import Scheduler


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


def collect_stats(scheduler: Scheduler) -> SchedulerStats:
    """The scheduler's counters now. Requests whose grammar compiles count as waiting."""
    block_manager = scheduler.block_manager
    return SchedulerStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting + scheduler.num_compiling,
        kv_cache_usage=scheduler.kv_cache_usage,
        num_free_blocks=block_manager.num_free_blocks,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens_total=scheduler.prompt_tokens_total,
        generation_tokens_total=scheduler.generation_tokens_total,
        num_steps_in_flight=scheduler.num_steps_in_flight,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        prompt_tokens_computed=scheduler.prompt_tokens_computed,
        num_cached_blocks=block_manager.num_cached_blocks,
    )
