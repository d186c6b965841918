"""tools/bench_ab: variants run alternately, each with its environment, and compared."""

from __future__ import annotations

import json
import sys

import pytest

from tools.bench_ab import Variant, compare, main, parse_variant, read_rows

# A stand-in benchmark: its step time comes from the environment, and it logs the order it
# was run in.
FAKE_BENCH = """
import json, os, sys
out = sys.argv[sys.argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
with open(os.environ["ORDER_LOG"], "a") as f:
    f.write(os.environ.get("SPEED", "base") + "\\n")
ms = {"base": 2.0, "fast": 1.5}[os.environ.get("SPEED", "base")]
rows = [{"context": c, "ms_per_step_median": ms * (1 + c / 1000)} for c in (128, 4096)]
json.dump({"results": rows}, open(os.path.join(out, "latency.json"), "w"))
"""


def test_variants_alternate_and_are_compared(tmp_path, monkeypatch, capsys):
    script = tmp_path / "fake_bench.py"
    script.write_text(FAKE_BENCH)
    order = tmp_path / "order.log"
    monkeypatch.setenv("ORDER_LOG", str(order))
    out = tmp_path / "ab"
    code = main(
        ["--variant", "base:", "--variant", "fast:SPEED=fast", "--rounds", "2",
         "--out", str(out), "--", sys.executable, str(script)]
    )  # fmt: skip
    assert code == 0
    assert order.read_text().split() == ["base", "fast", "base", "fast"]
    payload = json.loads((out / "ab.json").read_text())
    assert payload["variants"] == [
        {"name": "base", "env": {}},
        {"name": "fast", "env": {"SPEED": "fast"}},
    ]
    assert (out / "ab.png").read_bytes()[:4] == b"\x89PNG"
    table = capsys.readouterr().out
    assert "fast / base" in table and "0.75" in table


def test_compare_gives_rounds_medians_and_ratios():
    variants = [Variant("a", {}), Variant("b", {"X": "1"})]
    measured = {"a": [{1: 2.0}, {1: 4.0}, {1: 3.0}], "b": [{1: 1.0}, {1: 1.5}, {1: 9.0}]}
    columns, rows = compare(variants, measured)
    assert columns == [
        "key",
        "a r1",
        "a r2",
        "a r3",
        "a med",
        "b r1",
        "b r2",
        "b r3",
        "b med",
        "b / a",
    ]
    assert rows == [[1, 2.0, 4.0, 3.0, 3.0, 1.0, 1.5, 9.0, 1.5, 0.5]]


def test_bad_variants_and_results_are_refused(tmp_path):
    assert parse_variant("pdl-off:PEGAINFER_PDL=0,X=1") == Variant(
        "pdl-off", {"PEGAINFER_PDL": "0", "X": "1"}
    )
    # A value may hold commas: an item with no "=" continues the value before it.
    assert parse_variant("late:PEGAINFER_LATE_LAUNCH=skinny_add,rotary,X=1") == Variant(
        "late", {"PEGAINFER_LATE_LAUNCH": "skinny_add,rotary", "X": "1"}
    )
    # and so may "=": no variable name before it (a shape, here) continues the value too.
    assert parse_variant("t:PEGAINFER_LINEAR_TILES=2560,9728=4,512,4,4;2560,4096=2,512,4,X=1") == (
        Variant("t", {"PEGAINFER_LINEAR_TILES": "2560,9728=4,512,4,4;2560,4096=2,512,4", "X": "1"})
    )
    for spec in ("nocolon", ":X=1", "a:X", "a/b:X=1", "a:X,Y=1"):
        with pytest.raises(ValueError, match="variant"):
            parse_variant(spec)
    with pytest.raises(ValueError, match="found 0"):
        read_rows(str(tmp_path), "context", "ms")
    (tmp_path / "r.json").write_text(json.dumps({"results": [{"context": 1}]}))
    with pytest.raises(ValueError, match="lacks"):
        read_rows(str(tmp_path), "context", "ms")
    with pytest.raises(SystemExit):
        main(["--variant", "a:", "--out", str(tmp_path), "--", "true"])  # one variant only


def test_a_failing_run_stops_the_comparison(tmp_path, capsys):
    code = main(["--variant", "a:", "--variant", "b:", "--out", str(tmp_path / "ab"), "--",
                 sys.executable, "-c", "raise SystemExit(3)"])  # fmt: skip
    assert code == 1
    assert "a round 1 exited 3" in capsys.readouterr().out
