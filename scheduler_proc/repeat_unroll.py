"""Regex and EBNF constraints rewritten into the forms xgrammar masks quickly, with the same
language.

xgrammar turns ``X+`` and ``X{n,}`` into a recursive rule, and ``X{n}`` into a counted
repetition; from either, filling a row's mask costs hundreds of microseconds in every state
(``[a-z ,.]+`` on Qwen3's vocabulary: about 500 us), where ``X X*`` or ``X`` written out n
times costs a few (its character-class star has a precomputed mask). At 64 constrained rows
that is the difference between a mask that hides behind the forward pass and one that
doubles the step. So a single-character atom (a literal, an escape, a class or ``.``)
followed by such a quantifier is written out: ``X+`` as ``XX*``, ``X{n,}`` as n copies then
``X*``, ``X{n}`` as n copies, n at most ``MAX_COPIES``.

An EBNF grammar is read by xgrammar and printed back, one rule a line; a rule of the form
``r ::= (([class] r) | ([class]))`` (what ``[class]+`` becomes) is written ``[class] [class]*``.

Everything else is left as written: groups (xgrammar's star of a group is itself a recursive
rule), bounded ``X{n,m}``, lazy and possessive quantifiers. A pattern that this scanner does
not fully understand is returned unchanged, so xgrammar sees and judges the user's own.
"""

from __future__ import annotations

import re
from typing import Any

MAX_COPIES = 16

# Escapes that stand for one character or one class of them; any other letter escape (a
# backreference, \b, \p{..}) is not rewritten around.
_CLASS_ESCAPES = frozenset("dDwWsStnrfv")
_HEX_ESCAPE = re.compile(r"\\(?:x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4})")
_COUNT = re.compile(r"\{(\d+)(,?)(\d*)\}")
# The openings of groups that capture nothing or are named, and of lookarounds.
_GROUP_OPENING = re.compile(r"\(\?(?:P?<[A-Za-z_]\w*>|[:=!]|<[=!])")


# A rule that repeats one character class once or more, as xgrammar prints it.
_CLASS_PLUS_RULE = re.compile(
    r"(?P<name>[A-Za-z_][\w.-]*) ::= \(\((?P<atom>\[(?:[^\]\\]|\\.)*\]) (?P=name)\) \| \((?P=atom)\)\)"
)


class _Unsure(Exception):
    """The scanner met syntax it does not model; the pattern is kept as written."""


def unroll_regex(pattern: str) -> str:
    """``pattern`` with its single-atom ``+``, ``{n,}`` and ``{n}`` written out (module doc)."""
    try:
        return "".join(_rewrite(_tokens(pattern)))
    except _Unsure:
        return pattern


def unroll_ebnf(xgrammar: Any, grammar: str) -> str:
    """``grammar`` as xgrammar prints it, its class-plus rules written as a class star; the
    grammar itself when it has none, or when xgrammar's print does not read back the same."""
    printed = str(xgrammar.Grammar.from_ebnf(grammar))
    rules = printed.split("\n")
    unrolled = [_unroll_rule(rule) for rule in rules]
    if unrolled == rules or str(xgrammar.Grammar.from_ebnf(printed)) != printed:
        return grammar
    return "\n".join(unrolled)


def _unroll_rule(rule: str) -> str:
    match = _CLASS_PLUS_RULE.fullmatch(rule)
    if match is None:
        return rule
    name, atom = match.group("name", "atom")
    return f"{name} ::= (({atom} {atom}*))"


def unroll_schema_patterns(schema: Any) -> Any:
    """A JSON schema with each string ``pattern`` rewritten by ``unroll_regex``; instance
    data inside it (``enum``, ``const``, ``default``, ``examples``) is left alone."""
    if isinstance(schema, list):
        return [unroll_schema_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {}
    for key, value in schema.items():
        if key == "pattern" and isinstance(value, str):
            rewritten[key] = unroll_regex(value)
        elif key in ("enum", "const", "default", "examples"):
            rewritten[key] = value
        else:
            rewritten[key] = unroll_schema_patterns(value)
    return rewritten


def _tokens(pattern: str) -> list[tuple[str, str]]:
    """The pattern as (kind, text) pieces: kind "atom" for one character's worth, "count"
    for a quantifier, "other" for anything a quantifier must not be moved across."""
    tokens: list[tuple[str, str]] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            end, is_atom = _escape_end(pattern, i)
            tokens.append(("atom" if is_atom else "other", pattern[i:end]))
            i = end
        elif char == "[":
            end = _class_end(pattern, i)
            tokens.append(("atom", pattern[i:end]))
            i = end
        elif char in "*+?":
            tokens.append(("count", char))
            i += 1
        elif char == "{":
            match = _COUNT.match(pattern, i)
            if match is None:
                raise _Unsure  # a literal brace, or a form some dialects read differently
            tokens.append(("count", match.group()))
            i = match.end()
        elif pattern.startswith("(?", i):
            match = _GROUP_OPENING.match(pattern, i)
            if match is None:
                raise _Unsure  # inline flags and other extensions
            tokens.append(("other", match.group()))
            i = match.end()
        elif char in "()|^$":
            tokens.append(("other", char))
            i += 1
        else:
            tokens.append(("atom", char))
            i += 1
    return tokens


def _escape_end(pattern: str, start: int) -> tuple[int, bool]:
    """Where the escape at ``start`` ends, and whether it stands for one character."""
    if start + 1 >= len(pattern):
        raise _Unsure
    hex_escape = _HEX_ESCAPE.match(pattern, start)
    if hex_escape is not None:
        return hex_escape.end(), True
    escaped = pattern[start + 1]
    if escaped in _CLASS_ESCAPES or not escaped.isalnum():
        return start + 2, True
    if escaped in "pPxuck" or escaped.isdigit():
        raise _Unsure  # longer forms (\p{L}, \x{..}, \cX, \k<name>, \12) are not modelled
    return start + 2, False


def _class_end(pattern: str, start: int) -> int:
    """The index just past the character class that opens at ``start``."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        raise _Unsure  # a member in some dialects, an empty class in others
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
        elif char == "[":
            raise _Unsure  # nested classes and [:alpha:] differ between dialects
        elif char == "]":
            return i + 1
        else:
            i += 1
    raise _Unsure


def _rewrite(tokens: list[tuple[str, str]]) -> list[str]:
    pieces: list[str] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        count = tokens[i + 1][1] if i + 1 < len(tokens) and tokens[i + 1][0] == "count" else ""
        # A quantifier followed by ? or + (lazy, possessive) or another: kept as written.
        modified = i + 2 < len(tokens) and tokens[i + 2][0] == "count"
        copies = _copies(count) if kind == "atom" and count and not modified else None
        if copies is None:
            pieces.append(text)
            i += 1
            continue
        required, unbounded = copies
        pieces.append(text * required + (text + "*" if unbounded else ""))
        i += 2
    return pieces


def _copies(count: str) -> tuple[int, bool] | None:
    """(copies required, whether a star follows) for the quantifiers rewritten, else None."""
    if count == "+":
        return 1, True
    match = _COUNT.fullmatch(count)
    if match is None:
        return None
    low, comma, high = match.groups()
    required = int(low)
    if required > MAX_COPIES or high or not (required or comma):
        return None
    return required, bool(comma)
