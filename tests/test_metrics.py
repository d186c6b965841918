"""The Prometheus exposition written by hand: histogram arithmetic and a parseable format."""

from __future__ import annotations

import math
import re

from frontend_proc.metrics import Histogram, RequestMetrics, render
from pegainfer.protocol import EngineStats

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (-?[0-9.e+-]+|NaN|\+Inf|-Inf)$")


def parse(text: str) -> dict[str, float]:
    """Every sample line, checked against the format, keyed by name plus labels."""
    samples = {}
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram"), line
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not an exposition line: {line!r}"
        samples[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    for name, kind in types.items():
        if kind == "counter":
            assert any(key.startswith(name + "_total") for key in samples), name
    return samples


def test_histogram_buckets_are_cumulative():
    histogram = Histogram("x:latency_seconds", "help", [0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 2.0, float("nan")):
        histogram.observe(value)
    lines = histogram.render({"m": "a"})
    samples = parse("\n".join(lines))
    assert samples['x:latency_seconds_bucket{m="a",le="0.1"}'] == 2  # le is inclusive
    assert samples['x:latency_seconds_bucket{m="a",le="1"}'] == 3
    assert samples['x:latency_seconds_bucket{m="a",le="+Inf"}'] == 4
    assert samples['x:latency_seconds_count{m="a"}'] == 4
    assert math.isclose(samples['x:latency_seconds_sum{m="a"}'], 2.65)


def test_render_has_every_metric_with_the_scheduler_values():
    stats = EngineStats(3, 7, 0.25, 2, 100, 40, 80, 20, 1, 0.01)
    requests = RequestMetrics()
    requests.time_to_first_token.observe(0.2)
    requests.count_finished("stop")
    requests.count_finished("abort")
    samples = parse(render('my "model"', stats, requests, num_in_flight=5))
    label = '{model_name="my \\"model\\""}'
    assert samples["pegainfer:num_requests_running" + label] == 3
    assert samples["pegainfer:num_requests_waiting" + label] == 7
    assert samples["pegainfer:kv_cache_usage_perc" + label] == 0.25
    assert samples["pegainfer:num_preemptions_total" + label] == 2
    assert samples["pegainfer:prompt_tokens_total" + label] == 100
    assert samples["pegainfer:generation_tokens_total" + label] == 40
    assert samples["pegainfer:prefix_cache_queries_total" + label] == 80
    assert samples["pegainfer:prefix_cache_hits_total" + label] == 20
    assert samples["pegainfer:prefix_cache_hit_rate" + label] == 0.25
    assert samples["pegainfer:num_requests_in_flight" + label] == 5
    assert samples["pegainfer:time_to_first_token_seconds_count" + label] == 1
    for name in ("inter_token_latency", "e2e_request_latency", "request_queue_time"):
        assert samples[f"pegainfer:{name}_seconds_count" + label] == 0
    abort_label = '{model_name="my \\"model\\"",finished_reason="abort"}'
    assert samples["pegainfer:request_success_total" + abort_label] == 1


def test_render_before_any_stats_reports_zeros():
    samples = parse(render("m", None, RequestMetrics()))
    assert samples['pegainfer:num_requests_running{model_name="m"}'] == 0
    assert samples['pegainfer:healthy{model_name="m"}'] == 1
