"""The <think> parser: whole outputs, and streamed text split anywhere (tags included)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from frontend_proc.reasoning import ReasoningParser, split_reasoning


def stream(pieces: list[str]) -> tuple[str, str, bool]:
    parser = ReasoningParser()
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning += r
        content += c
    r, c = parser.flush()
    return reasoning + r, content + c, parser.saw_think


def test_think_block_is_split_from_the_answer():
    assert split_reasoning("<think>\nLet me see.\n</think>\n\nParis.") == (
        "\nLet me see.\n",
        "\n\nParis.",
    )


def test_output_without_a_think_block_is_all_content():
    assert split_reasoning("Paris. <think>not a block</think>") == (
        None,
        "Paris. <think>not a block</think>",
    )
    assert split_reasoning("") == (None, "")


def test_output_of_a_prompt_that_opened_the_block_starts_as_reasoning():
    # Qwen3's thinking-only models: the template writes "<think>\n", the model the rest.
    assert split_reasoning("Let me see.\n</think>\n\nParis.", starts_in_reasoning=True) == (
        "Let me see.\n",
        "\n\nParis.",
    )
    assert split_reasoning("still going", starts_in_reasoning=True) == ("still going", "")
    parser = ReasoningParser()
    parser.start_in_reasoning()  # as the first streamed delta says
    pieces = [parser.feed(piece) for piece in ["Let me", " see.</th", "ink>Par", "is."]]
    assert "".join(r for r, _ in pieces) == "Let me see."
    assert "".join(c for _, c in pieces) == "Paris."


def test_unfinished_reasoning_stays_reasoning():
    assert split_reasoning("  <think>still going") == ("still going", "")


def test_tags_split_across_deltas_never_leak():
    pieces = ["<th", "ink>", "a</", "thi", "nk", ">b"]
    parser = ReasoningParser()
    outputs = [parser.feed(piece) for piece in pieces] + [parser.flush()]
    assert all("<" not in r and "<" not in c for r, c in outputs)
    assert "".join(r for r, _ in outputs) == "a"
    assert "".join(c for _, c in outputs) == "b"


@settings(max_examples=200, deadline=None)
@given(
    reasoning=st.text(alphabet="ab<>/ \n", max_size=12).filter(lambda t: "</think>" not in t),
    answer=st.text(alphabet="ab<>/ \n", max_size=12),
    think=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=10),
)
def test_streamed_split_equals_whole_split(reasoning, answer, think, cuts):
    text = f"<think>{reasoning}</think>{answer}" if think else answer
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    streamed_reasoning, streamed_content, saw = stream(pieces)
    whole_reasoning, whole_content = split_reasoning(text)
    assert streamed_content == whole_content
    assert (streamed_reasoning if saw else None) == whole_reasoning
    if think:
        assert whole_reasoning == reasoning and whole_content == answer
