"""A constraint that compiles too long is refused, and the ones queued behind it go on."""

from __future__ import annotations

import threading
import time

import pytest

from pegainfer.cli import build_parser, config_from_args
from pegainfer.config import read_model_info
from pegainfer.protocol import StructuredOutput
from scheduler_proc.grammar import GrammarCompiler
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_sim import make_config
from tests.test_structured_output import request

pytest.importorskip("xgrammar")

SLOW = "[a-z]{1,3}"  # the one compile held up by the test's compiler


@pytest.fixture
def slow_compiles(monkeypatch):
    """Compiles of ``SLOW`` wait for the returned event (or 30 s)."""
    release = threading.Event()
    compile_now = GrammarCompiler.compile

    def compile_slowly(self, structured):
        if structured.spec == SLOW:
            release.wait(30)
        return compile_now(self, structured)

    monkeypatch.setattr(GrammarCompiler, "compile", compile_slowly)
    yield release
    release.set()


def scheduler_with_deadline(model_dir: str, seconds: float) -> Scheduler:
    model = read_model_info(model_dir)
    return Scheduler(
        make_config(
            model_path=model_dir, model=model, max_model_len=256, num_kv_blocks=256,
            grammar_compile_timeout=seconds,
        )
    )  # fmt: skip


def settle_until(scheduler: Scheduler, done, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    rejections = []
    while not done():
        assert time.monotonic() < deadline, "the scheduler did not settle"
        rejections += scheduler.collect_grammars()
        time.sleep(0.005)
    return rejections


def test_an_overrun_compile_is_refused_and_the_queue_behind_it_moves(
    tiny_qwen3_dir, slow_compiles
) -> None:
    scheduler = scheduler_with_deadline(tiny_qwen3_dir, 0.5)
    # The first compile loads xgrammar: that time does not count against its deadline.
    assert scheduler.add_request(request("first", StructuredOutput("regex", "[ab]"))) is None
    assert settle_until(scheduler, lambda: scheduler.num_compiling == 0) == []
    started = time.monotonic()
    assert scheduler.add_request(request("slow", StructuredOutput("regex", SLOW))) is None
    assert scheduler.add_request(request("next", StructuredOutput("choice", '["x"]'))) is None
    rejections = settle_until(scheduler, lambda: scheduler.num_compiling == 0)
    waited = time.monotonic() - started
    (rejection,) = rejections
    assert rejection.request_id == "slow" and rejection.status == 400
    assert "did not compile within 0.5 s" in rejection.message
    assert scheduler.get_request("slow") is None
    # The request queued behind it compiled on a new thread, long before the slow one ends.
    assert scheduler.get_request("next").grammar is not None
    assert 0.5 <= waited < 10
    assert scheduler.constrained._compiler.num_abandoned == 1
    assert scheduler.constrained.num_live == 2  # "first" and "next"
    # The abandoned compile ends on its own thread, and nothing waits for it.
    slow_compiles.set()
    assert scheduler.add_request(request("later", StructuredOutput("regex", "[cd]"))) is None
    assert settle_until(scheduler, lambda: scheduler.num_compiling == 0) == []


def test_no_deadline_with_zero(tiny_qwen3_dir, slow_compiles) -> None:
    scheduler = scheduler_with_deadline(tiny_qwen3_dir, 0.0)
    assert scheduler.add_request(request("slow", StructuredOutput("regex", SLOW))) is None
    time.sleep(0.3)
    assert scheduler.collect_grammars() == [] and scheduler.num_compiling == 1
    slow_compiles.set()
    assert settle_until(scheduler, lambda: scheduler.num_compiling == 0) == []
    assert scheduler.get_request("slow").grammar is not None


def test_the_deadline_is_a_server_option() -> None:
    parser = build_parser()
    args = parser.parse_args(["--grammar-compile-timeout", "2.5"])
    assert config_from_args(args).grammar_compile_timeout == 2.5
    assert config_from_args(parser.parse_args([])).grammar_compile_timeout == 10.0
    with pytest.raises(SystemExit, match="grammar-compile-timeout"):
        config_from_args(parser.parse_args(["--grammar-compile-timeout", "-1"]))


def test_while_two_overrun_compiles_still_run_new_constraints_are_turned_away(
    tiny_qwen3_dir, slow_compiles
) -> None:
    scheduler = scheduler_with_deadline(tiny_qwen3_dir, 0.3)
    for request_id in ("slow-1", "slow-2"):
        assert scheduler.add_request(request(request_id, StructuredOutput("regex", SLOW))) is None
    rejections = settle_until(scheduler, lambda: scheduler.num_compiling == 0)
    assert [r.request_id for r in rejections] == ["slow-1", "slow-2"]
    assert all(r.status == 400 for r in rejections)
    busy = scheduler.add_request(request("more", StructuredOutput("regex", "[ab]")))
    assert busy is not None and busy.status == 503 and busy.code == "grammar_compiler_busy"
    assert scheduler.get_request("more") is None and scheduler.constrained.num_live == 0
    # Unconstrained requests are not affected.
    assert scheduler.add_request(request("free", None)) is None
    slow_compiles.set()  # both end; new constraints compile again
    deadline = time.monotonic() + 30
    while scheduler.add_request(request("more", StructuredOutput("regex", "[ab]"))) is not None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert settle_until(scheduler, lambda: scheduler.num_compiling == 0) == []


@pytest.mark.slow
def test_through_the_server_an_overrun_is_a_400_and_a_full_compiler_a_503(
    tiny_qwen3_dir, tmp_path
) -> None:
    import json
    import urllib.error
    import urllib.request

    from tests.server_util import Server

    server = Server(
        "--model-path", tiny_qwen3_dir, "--device", "cpu", "--kv-cache-memory", "64MiB",
        "--max-model-len", "256", "--grammar-compile-timeout", "0.05",
        log_path=str(tmp_path / "pegainfer.log"),
    ).wait_ready()  # fmt: skip
    try:
        body = {"prompt": "hi", "max_tokens": 4}
        status, out = server.post("/v1/completions", {**body, "guided_regex": "[ab]"})
        assert status == 200, out  # xgrammar loaded: its load is not a compile's time
        # Each takes about a second to compile on this machine's cores.
        for regex in ("[a-z]{1,1000}", "[b-z]{1,1000}"):
            status, out = server.post("/v1/completions", {**body, "guided_regex": regex})
            assert status == 400, out
            assert "did not compile within 0.05 s" in out["error"]["message"]
        request = urllib.request.Request(
            server.url("/v1/completions"),
            data=json.dumps({**body, "guided_regex": "[cd]"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(request, timeout=60)
        assert caught.value.code == 503 and caught.value.headers["Retry-After"]
        assert json.loads(caught.value.read())["error"]["code"] == "grammar_compiler_busy"
        status, out = server.post("/v1/completions", body)  # unconstrained: served
        assert status == 200, out
    finally:
        assert server.stop() == 0, server.log()[-3000:]
    assert server.leftovers() == []
