"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand.

Names follow vLLM's meanings under the ``pegainfer:`` prefix. The scheduler's gauges and
counters come from its latest ``EngineStats``; latencies are measured here, per request, as
the frontend sees them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable

from pegainfer.protocol import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)  # fmt: skip


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape_label(value)}"' for key, value in labels.items())
    return "{" + inner + "}"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: Iterable[float]) -> None:
        self.name = name
        self.help = help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        value = max(value, 0.0)
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, labels: dict[str, str]) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts):
            cumulative += count
            bucket_labels = {**labels, "le": _format_value(float(bound))}
            lines.append(f"{self.name}_bucket{_labels(bucket_labels)} {cumulative}")
        lines.append(f"{self.name}_sum{_labels(labels)} {_format_value(self.sum)}")
        lines.append(f"{self.name}_count{_labels(labels)} {self.count}")
        return lines


class RequestMetrics:
    """Latencies and outcomes of the requests this frontend served."""

    def __init__(self) -> None:
        self.time_to_first_token = Histogram(
            "pegainfer:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            "pegainfer:inter_token_latency_seconds",
            "Time between consecutive output deltas of one request, per token.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = Histogram(
            "pegainfer:e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            REQUEST_BUCKETS,
        )
        self.request_queue_time = Histogram(
            "pegainfer:request_queue_time_seconds",
            "Time a request waited before the scheduler first ran it.",
            REQUEST_BUCKETS,
        )
        self.finished: dict[str, int] = {}  # by finish reason, "error" included

    def histograms(self) -> list[Histogram]:
        return [
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
        ]

    def count_finished(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


def _sample(
    name: str, kind: str, help_text: str, value: float, labels: dict[str, str]
) -> list[str]:
    sample_name = name + "_total" if kind == "counter" else name
    return [
        f"# HELP {name} {help_text}",
        f"# TYPE {name} {kind}",
        f"{sample_name}{_labels(labels)} {_format_value(value)}",
    ]


def render(
    model_name: str,
    stats: EngineStats | None,
    requests: RequestMetrics,
    num_in_flight: int = 0,
    healthy: bool = True,
) -> str:
    labels = {"model_name": model_name}
    s = stats or EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0.0)
    hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    lines: list[str] = []
    for name, kind, help_text, value in (
        ("num_requests_running", "gauge", "Requests running on the engine.", s.num_running),
        ("num_requests_waiting", "gauge", "Requests waiting to run.", s.num_waiting),
        (
            "kv_cache_usage_perc",
            "gauge",
            "KV-cache usage: 1 means every block is held by a request.",
            s.kv_cache_usage,
        ),
        (
            "prefix_cache_queries",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        ),
        (
            "prefix_cache_hits",
            "counter",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        ),
        ("prefix_cache_hit_rate", "gauge", "Prefix-cache hits over queries.", hit_rate),
        ("num_preemptions", "counter", "Requests preempted for KV space.", s.num_preemptions),
        ("prompt_tokens", "counter", "Prefilled prompt tokens.", s.prompt_tokens_total),
        ("generation_tokens", "counter", "Generated tokens.", s.generation_tokens_total),
        (
            "num_requests_in_flight",
            "gauge",
            "Engine requests the HTTP frontend is waiting on.",
            num_in_flight,
        ),
        ("healthy", "gauge", "1 while the server accepts requests.", 1 if healthy else 0),
    ):
        lines += _sample(f"pegainfer:{name}", kind, help_text, value, labels)
    lines += [
        "# HELP pegainfer:request_success Finished requests by finish reason.",
        "# TYPE pegainfer:request_success counter",
    ]
    for reason in sorted(requests.finished) or ["stop"]:
        count = requests.finished.get(reason, 0)
        reason_labels = {**labels, "finished_reason": reason}
        lines.append(f"pegainfer:request_success_total{_labels(reason_labels)} {count}")
    for histogram in requests.histograms():
        lines += histogram.render(labels)
    return "\n".join(lines) + "\n"
