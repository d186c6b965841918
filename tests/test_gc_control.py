"""The garbage collector's start-up freeze and the watch over later collections."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys

import pytest

from pegainfer.gc_control import GC_FREEZE_ENV, GC_WARN_ENV, CollectionWatch, warn_threshold_s

# Run in a child: freezing would exempt the test session's own heap from collection.
_FREEZE_CHILD = """
import gc, json
from pegainfer.gc_control import freeze_startup_heap

gc.disable()  # only the explicit collections below count what they free

class Node:
    pass

def cycles(n):
    for _ in range(n):
        a, b = Node(), Node()
        a.other, b.other = b, a

kept = [[Node() for _ in range(10)] for _ in range(20000)]  # start-up's long-lived heap
cycles(500)                                                   # and its cyclic garbage
tracked_before = len(gc.get_objects())
freeze = freeze_startup_heap()
tracked_after = len(gc.get_objects())
cycles(300)  # serving's garbage, after the freeze: still collected
collected_later = gc.collect()
print(json.dumps(dict(
    frozen=freeze.frozen_objects, collected=freeze.collected, tracked_before=tracked_before,
    tracked_after=tracked_after, collected_later=collected_later,
    freeze_count=gc.get_freeze_count(), kept=len(kept),
)))
"""


def test_freeze_collects_startup_garbage_then_exempts_the_survivors():
    proc = subprocess.run(
        [sys.executable, "-c", _FREEZE_CHILD], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # The 500 start-up cycles (two objects and their dicts each) were freed first.
    assert report["collected"] >= 1000
    assert report["frozen"] == report["freeze_count"] >= 200_000
    # A full collection no longer walks the frozen heap ...
    assert report["tracked_before"] >= 200_000
    assert report["tracked_after"] < 1_000
    # ... and still frees cycles made after the freeze.
    assert report["collected_later"] >= 600


def test_watch_times_each_collection_and_logs_the_slow_ones(caplog):
    slow = CollectionWatch(warn_s=0.0).install()
    quiet = CollectionWatch(warn_s=3600.0).install()
    try:
        with caplog.at_level(logging.WARNING, logger="pegainfer.gc_control"):
            gc.collect(0)
            gc.collect(2)
    finally:
        slow.remove()
        quiet.remove()
    assert slow not in gc.callbacks and quiet not in gc.callbacks
    for watch in (slow, quiet):
        assert watch.counts[0] >= 1 and watch.counts[2] >= 1
        assert all(seconds >= 0 for seconds in watch.seconds)
    assert slow.slow >= 2 and quiet.slow == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any("generation-2 garbage collection paused this process" in m for m in messages)
    assert any("generation-0 garbage collection" in m for m in messages)


def test_installing_twice_hooks_once():
    watch = CollectionWatch()
    try:
        watch.install()
        watch.install()
        assert sum(1 for hook in gc.callbacks if hook is watch) == 1
    finally:
        watch.remove()


@pytest.mark.parametrize(
    ("value", "seconds"), [("", 0.020), ("5", 0.005), ("0", 0.0), ("-3", 0.0), ("soon", 0.020)]
)
def test_warn_threshold_from_the_environment(monkeypatch, value, seconds):
    monkeypatch.setenv(GC_WARN_ENV, value)
    assert warn_threshold_s() == pytest.approx(seconds)


_SETTLE_CHILD = """
import gc, json, logging, sys
from pegainfer.gc_control import log_collections, settle_heap

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
settle_heap("probe")
settle_heap("probe")  # a second call adds no second watch
gc.collect(2)
log_collections("probe")
print(json.dumps(dict(frozen=gc.get_freeze_count(), hooks=len(gc.callbacks))))
"""


@pytest.mark.parametrize("freeze", ["1", "0"])
def test_settle_heap_freezes_unless_told_not_to_and_reports_at_the_end(freeze):
    proc = subprocess.run(
        [sys.executable, "-c", _SETTLE_CHILD],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, GC_FREEZE_ENV: freeze},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["hooks"] == 1
    if freeze == "0":
        assert report["frozen"] == 0
        assert "probe: start-up heap left unfrozen (PEGAINFER_GC_FREEZE=0)" in proc.stderr
    else:
        assert report["frozen"] > 1_000
        assert "probe: froze" in proc.stderr
    assert "probe: garbage collections since ready: generation 0 " in proc.stderr
    assert "generation 2 " in proc.stderr and "; the longest " in proc.stderr


_IMPORTS_CHILD = """
import gc, json, logging, sys
if sys.argv[1] == "off":
    gc.disable()
import email.parser, json.decoder, xml.dom.minidom  # some imports' objects
from pegainfer.gc_control import freeze_imports, settle_heap

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
freeze_imports()
frozen_by_imports = gc.get_freeze_count()
enabled = gc.isenabled()
settle_heap("probe")
print(json.dumps(dict(frozen_by_imports=frozen_by_imports, enabled=enabled)))
"""


@pytest.mark.parametrize(
    ("collector", "freeze", "frozen"), [("off", "1", True), ("off", "0", False), ("on", "1", False)]
)
def test_freeze_imports_only_where_the_imports_ran_without_the_collector(collector, freeze, frozen):
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTS_CHILD, collector],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, GC_FREEZE_ENV: freeze},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["enabled"] is True
    assert (report["frozen_by_imports"] > 1_000) is frozen
    # Start-up's collections after the imports are counted where the imports ran without it.
    counted = "probe: garbage collections during start-up, after its imports: " in proc.stderr
    assert counted is (collector == "off")
