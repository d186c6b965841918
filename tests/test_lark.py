"""Lark grammars written out as EBNF: the sentences xgrammar allows are the ones Lark parses."""

from __future__ import annotations

import random
import string

import pytest

from scheduler_proc.lark import LarkError, is_lark, lark_to_ebnf

SQL = """
// vLLM's example, in Lark
start: select_statement
select_statement: "SELECT " column " from " table " where " condition
column: "col_1 " | "col_2 "
table: "table_1 " | "table_2 "
condition: column "= " number
number: "1 " | "2 "
"""

FEATURES = r"""
?start: item ("," item)* -> items   # a comment after a rule
item: WORD ["!" "?"?]
    | "x".."z" ~ 2..3
    | "IF"i
    | /[0-9]+(\.[0-9]+)?/
    | ESCAPED_STRING
    | "a // b" ( "b" | "c" )+
    | DIGIT ~ 2
%import common.WORD
%import common (ESCAPED_STRING, DIGIT)
"""

SAMPLES = {
    SQL: ["SELECT col_1  from table_2  where col_2 = 1 ", "SELECT col_2  from table_1  where col_1 = 2 "],
    FEATURES: [
        "hello", "hello!", "hello!?", "xy", "zzz", "if", "iF", "If", "12", "3.25", '"a\\"b"',
        "a // bbc", "a // c", "07", "hello,xy,3.5,IF", 'x,"",a // b',
    ],
}  # fmt: skip


def test_lark_is_told_from_ebnf_by_its_rules() -> None:
    assert is_lark(SQL) and is_lark(FEATURES)
    assert not is_lark('root ::= "a" // a comment: "b"')
    assert is_lark('start: "a ::= b"') is False  # as vLLM tells them (the text has ::=)


def test_the_sql_example_becomes_its_ebnf() -> None:
    assert lark_to_ebnf(SQL).splitlines()[:3] == [
        "root ::= start",
        "start ::= select_statement",
        'select_statement ::= "SELECT " column " from " table " where " condition',
    ]


@pytest.mark.parametrize(
    ("grammar", "words"),
    [
        ("start: a\n%ignore WS", "%ignore"),
        ('start: "a" b{x}', "template"),
        ("start: /a/i", "flags"),
        ("start: x\n%import other.X", "%import common.NAME"),
        ("start: A\n%import common.SOMETHING", "SOMETHING"),
        ('start: "a"\nstart: "b"', "twice"),
        ('start: ("a"', "unclosed"),
        ('start: "a"]', "unmatched"),
        ('start: "ab".."z"', "one-character"),
        ('| "a"', "outside a rule"),
        ("start: * 'a'", "follows nothing"),
        ("just words", "expected"),
        ('start: "a" ~', "count"),
        ('start: "a" ~ 3..2', "counts down"),
        ('start: r\nroot: "a"', "'root'"),
    ],
)
def test_what_has_no_ebnf_form_is_refused_with_its_line(grammar: str, words: str) -> None:
    with pytest.raises(LarkError, match="Lark grammar") as caught:
        lark_to_ebnf(grammar)
    assert words in str(caught.value)


@pytest.fixture(scope="module")
def char_compiler():
    xgrammar = pytest.importorskip("xgrammar")
    # One token per printable character, and a stop token: a walk spells any string.
    vocabulary = list(string.printable[:95]) + ["</s>"]
    info = xgrammar.TokenizerInfo(vocabulary, stop_token_ids=[len(vocabulary) - 1])
    return xgrammar, vocabulary, xgrammar.GrammarCompiler(info, max_threads=1)


def xgrammar_accepts(xgrammar, compiled, vocabulary, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(len(vocabulary) - 1)


def lark_accepts(parser, text: str) -> bool:
    import lark

    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


@pytest.mark.parametrize("grammar", [SQL, FEATURES], ids=["sql", "features"])
def test_xgrammar_allows_what_lark_parses(char_compiler, grammar: str) -> None:
    lark = pytest.importorskip("lark")
    xgrammar, vocabulary, compiler = char_compiler
    compiled = compiler.compile_grammar(lark_to_ebnf(grammar))
    parser = lark.Lark(grammar, parser="earley", lexer="dynamic_complete")
    rng = random.Random(11)
    # Lark's sentences, and each with one character dropped, doubled or changed.
    texts = list(SAMPLES[grammar])
    for text in SAMPLES[grammar]:
        for _ in range(25):
            at = rng.randrange(len(text))
            texts += [
                text[:at] + text[at + 1 :],
                text[:at] + text[at] + text[at:],
                text[:at] + rng.choice('ax1!,." /') + text[at + 1 :],
            ]
    agreed = 0
    for text in texts:
        expected = lark_accepts(parser, text)
        assert xgrammar_accepts(xgrammar, compiled, vocabulary, text) == expected, text
        agreed += expected
    assert agreed > len(SAMPLES[grammar])  # some changed texts are sentences too
    # And what xgrammar writes, walking its masks at random, Lark parses.
    for _ in range(30):
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, len(vocabulary))
        written = ""
        while not matcher.is_terminated() and len(written) < 60:
            matcher.fill_next_token_bitmask(mask, 0)
            allowed = [t for t in range(len(vocabulary)) if mask[0, t // 32] >> (t % 32) & 1]
            token = rng.choice(allowed)
            assert matcher.accept_token(token)
            written += vocabulary[token] if token < len(vocabulary) - 1 else ""
        if matcher.is_terminated():
            assert lark_accepts(parser, written), written
