"""Regex constraints written out for quick masks: the same language, the same masks."""

from __future__ import annotations

import json
import random
import re

import pytest

from scheduler_proc.repeat_unroll import (
    MAX_COPIES,
    unroll_ebnf,
    unroll_regex,
    unroll_schema_patterns,
)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("[a-z ,.]+", "[a-z ,.][a-z ,.]*"),
        (r"\d{3}-\d{4}", r"\d\d\d-\d\d\d\d"),
        (r"\w+@\w+\.com", r"\w\w*@\w\w*\.com"),
        ("a{2,}", "aaa*"),
        ("a{0,}", "a*"),
        (r"^\s*[A-Z]{3}\.?$", r"^\s*[A-Z][A-Z][A-Z]\.?$"),
        (r"(?:\d+)|(?P<word>x+)", r"(?:\d\d*)|(?P<word>xx*)"),
        (r"[\]a]+", r"[\]a][\]a]*"),
        (r"\x41+\u00e9{2}", r"\x41\x41*\u00e9\u00e9"),
        (".+", "..*"),
    ],
)
def test_single_atoms_are_written_out(pattern: str, expected: str) -> None:
    assert unroll_regex(pattern) == expected


@pytest.mark.parametrize(
    "pattern",
    [
        "(ab)+",  # a group: its star is no quicker to mask
        "a{2,5}",  # bounded: written out it is slower still
        f"a{{{MAX_COPIES + 1}}}",
        "a{0}",
        "a+?",  # lazy
        "a++",  # possessive
        "a+*",  # a second quantifier: an error to keep as the user's
        "(?i)a+",  # inline flags
        r"\p{L}+",
        r"(a)\1+",
        "[]a]+",  # a leading ] reads differently between dialects
        "[[:alpha:]]+",
        "a{",
        "a{,3}",
        "[a-z",
        "a\\",
    ],
)
def test_what_is_not_modelled_is_kept_as_written(pattern: str) -> None:
    assert unroll_regex(pattern) == pattern


ATOMS = ["a", "b", "[ab]", "[^a]", r"\d", ".", r"\.", " "]
COUNTS = ["", "", "+", "*", "?", "{2}", "{0,}", "{1,}", "{2,}", "{1,2}", "+?"]


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    pieces = []
    for _ in range(rng.randint(1, 4)):
        if depth < 2 and rng.random() < 0.2:
            inner = "|".join(random_pattern(rng, depth + 1) for _ in range(rng.randint(1, 2)))
            pieces.append(f"({inner})" + rng.choice(COUNTS))
        else:
            pieces.append(rng.choice(ATOMS) + rng.choice(COUNTS))
    return "".join(pieces)


def test_the_language_is_unchanged() -> None:
    rng = random.Random(20261205)
    rewritten = 0
    for _ in range(400):
        pattern = random_pattern(rng)
        unrolled = unroll_regex(pattern)
        rewritten += unrolled != pattern
        original, written_out = re.compile(pattern), re.compile(unrolled)
        for _ in range(60):
            text = "".join(rng.choice("ab1. ") for _ in range(rng.randint(0, 7)))
            assert bool(original.fullmatch(text)) == bool(written_out.fullmatch(text)), (
                pattern,
                unrolled,
                text,
            )
    assert rewritten > 200


def test_schema_patterns_are_written_out_but_not_instance_data() -> None:
    schema = {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"},
            "pattern": {"type": "string", "enum": ["a+"]},
            "tags": {
                "type": "array",
                "items": {"anyOf": [{"pattern": "x+"}, {"const": {"pattern": "y+"}}]},
            },
        },
        "default": {"pattern": "z+"},
    }
    unrolled = unroll_schema_patterns(schema)
    properties = unrolled["properties"]
    assert properties["code"]["pattern"] == "^[A-Z][A-Z][A-Z]-[0-9][0-9]*$"
    assert properties["pattern"] == schema["properties"]["pattern"]
    assert properties["tags"]["items"]["anyOf"] == [
        {"pattern": "xx*"},
        {"const": {"pattern": "y+"}},
    ]
    assert unrolled["default"] == {"pattern": "z+"}
    assert schema["properties"]["code"]["pattern"] == "^[A-Z]{3}-[0-9]+$"  # not modified in place


REGEXES = ["[ab .]+", r"a{2,}b+\.\d{2}", r"(a+|b{3}) [^a]+", r"\d+(\.\d+)?", "x{4}[yz]{0,}"]
GRAMMARS = [
    'root ::= [ab .]+ "." [0-9]+',
    'root ::= item+ "."\nitem ::= [ab]+ " " | "x" [yz]+',
    'root ::= word ".1"\nword ::= [^.]+ (=("."))',
]


@pytest.mark.parametrize(
    ("kind", "form"), [("regex", p) for p in REGEXES] + [("grammar", g) for g in GRAMMARS]
)
def test_xgrammar_masks_are_the_same_for_the_written_out_form(kind: str, form: str) -> None:
    xgrammar = pytest.importorskip("xgrammar")
    # Single characters, pairs and a few longer pieces: tokens that cross atom boundaries.
    vocabulary = sorted(
        {*"ab1. xyz", "ab", "ba", "a.", "11", "1.", " a", "aa", "bb", ".1", "aab", "b1b"}
    )
    vocabulary.append("</s>")
    info = xgrammar.TokenizerInfo(vocabulary, stop_token_ids=[len(vocabulary) - 1])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_form = compiler.compile_regex if kind == "regex" else compiler.compile_grammar
    written_out = unroll_regex(form) if kind == "regex" else unroll_ebnf(xgrammar, form)
    assert written_out != form
    rng = random.Random(7)
    for _ in range(8):  # walks of random allowed tokens
        matchers = [xgrammar.GrammarMatcher(compile_form(text)) for text in (form, written_out)]
        masks = [xgrammar.allocate_token_bitmask(1, len(vocabulary)) for _ in matchers]
        for _ in range(12):
            for matcher, mask in zip(matchers, masks, strict=True):
                matcher.fill_next_token_bitmask(mask, 0)
            assert masks[0].equal(masks[1]), (form, written_out)
            allowed = [
                token_id
                for token_id in range(len(vocabulary))
                if masks[0][0, token_id // 32] >> (token_id % 32) & 1
            ]
            token_id = rng.choice(allowed)
            assert all(matcher.accept_token(token_id) for matcher in matchers)
            if matchers[0].is_terminated():
                assert matchers[1].is_terminated()
                break


def test_ebnf_is_left_alone_where_no_rule_is_a_class_plus() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    grammars = [
        'root ::= "plain"',
        'root ::= ab\nab ::= [x] b | [x]\nb ::= "q"',
        'root ::= ("ab")+',
    ]
    for grammar in grammars:
        assert unroll_ebnf(xgrammar, grammar) == grammar
    with pytest.raises(RuntimeError, match="Unterminated character class"):
        unroll_ebnf(xgrammar, "root ::= [a-")


def test_ebnf_left_alone_where_nothing_is_a_class_plus() -> None:
    xgrammar = pytest.importorskip("xgrammar")
    for grammar in [
        'root ::= "plain"',
        'root ::= ab\nab ::= [x] b | [x]\nb ::= "q"',
        'root ::= ("ab")+',
    ]:
        assert unroll_ebnf(xgrammar, grammar) == grammar
    with pytest.raises(RuntimeError, match="Unterminated character class"):
        unroll_ebnf(xgrammar, "root ::= [a-")


def test_a_json_schema_constraint_compiles_with_its_patterns_written_out() -> None:
    pytest.importorskip("xgrammar")
    from scheduler_proc.grammar import _unrolled_schema

    schema = json.dumps({"type": "string", "pattern": "^[a-z]+$"})
    assert json.loads(_unrolled_schema(schema)) == {"type": "string", "pattern": "^[a-z][a-z]*$"}
    plain = json.dumps({"type": "string"})
    assert _unrolled_schema(plain) is plain
    assert _unrolled_schema("{not json") == "{not json"
