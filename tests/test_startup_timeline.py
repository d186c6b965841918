"""Start-up phases: marked in order, logged as one line, read back by tools."""

from __future__ import annotations

import subprocess
import sys
import time

from pegainfer.startup_timeline import (
    StartupTimeline,
    parse_timeline,
    seconds_since_process_start,
)
from tools.bench_startup import breakdown_tables, startup_breakdown


def test_phases_are_marked_in_order_and_round_trip():
    timeline = StartupTimeline(first_phase=None)
    time.sleep(0.02)
    timeline.mark("torch import")
    timeline.mark("kv cache")
    time.sleep(0.01)
    timeline.mark("graphs")
    names = [name for name, _ in timeline.phases]
    assert names == ["torch import", "kv cache", "graphs"]
    assert timeline.phases[0][1] >= 0.02 and timeline.phases[2][1] >= 0.01
    line = "12:00:00 INFO pegainfer::worker-0[7] worker_proc: " + timeline.summary()
    parsed = parse_timeline(line)
    assert list(parsed) == names
    for name, seconds in timeline.phases:
        assert abs(parsed[name] - seconds) <= 0.005
    assert parse_timeline("worker-0 ready in 3.2 s") is None
    assert parse_timeline("startup: not a phase list (total 1 s)") is None


def test_first_phase_counts_from_the_process_creation():
    age = seconds_since_process_start()
    assert age is not None and age > 0
    code = (
        "import time; t = time.monotonic(); "
        "from pegainfer.startup_timeline import StartupTimeline as T; "
        "tl = T(); print(tl.phases[0][0], tl.phases[0][1])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    name, seconds = out.stdout.split()
    # A fresh interpreter is a fraction of a second old, not as old as this test process.
    assert name == "interpreter" and 0 < float(seconds) < min(age, 30)


def test_bench_startup_reads_the_breakdown_from_a_server_log(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "20:52:16 INFO pegainfer::launcher[1] pegainfer.launcher: tokenizer-0 ready (pid 5) "
        "2.65 s after launch\n"
        "20:52:19 INFO pegainfer::worker-0[3] worker_proc: startup: interpreter 0.49 s, "
        "torch import 1.43 s, weights 0.22 s, graphs 2.00 s (total 4.14 s)\n"
        "20:52:19 INFO pegainfer::launcher[1] pegainfer.launcher: worker-0 ready (pid 3) "
        "4.40 s after launch\n"
        "20:52:19 INFO pegainfer::launcher[1] pegainfer.launcher: frontend ready (pid 9) "
        "4.93 s after launch\n"
    )
    found = startup_breakdown(str(log))
    assert found["worker_phases"] == {
        "interpreter": 0.49,
        "torch import": 1.43,
        "weights": 0.22,
        "graphs": 2.0,
    }
    assert found["ready_after_launch"] == {"tokenizer-0": 2.65, "worker-0": 4.4, "frontend": 4.93}
    other = {"worker_phases": {"interpreter": 0.51, "weights": 0.3}, "ready_after_launch": {}}
    text = breakdown_tables([found, other, found])
    assert "torch import" in text and "frontend" in text
    assert startup_breakdown(str(tmp_path / "absent.log")) == {
        "worker_phases": {},
        "ready_after_launch": {},
    }
