"""Lark grammars, written out as the EBNF that xgrammar compiles.

A ``grammar`` constraint with no ``::=`` outside its comments is read as Lark (as vLLM reads
it). Its rules (``name: ...``, ``?name: ...``, ``name.2: ...``, alternatives continued on
lines that begin with ``|``) become EBNF rules, ``start`` (else the first rule) the root.
Within a rule: strings in either quotes (``"if"i`` case-insensitive), ranges ``"a".."z"``,
regular expressions ``/.../``, ``[optional]``, groups, ``* + ?``, ``~ n`` and ``~ n..m``;
an alias (``-> name``) is dropped. ``%import common.NAME`` brings the usual terminals
(``COMMON_TERMINALS``). ``%ignore``, templates and regex flags have no EBNF form and are
refused, as is anything else the reader does not know, with the line it is on.
"""

from __future__ import annotations

import ast
import json
import re

from scheduler_proc.repeat_unroll import unroll_regex

# Lark's common.lark terminals, as regular expressions.
COMMON_TERMINALS = {
    "DIGIT": r"[0-9]",
    "HEXDIGIT": r"[0-9a-fA-F]",
    "INT": r"[0-9]+",
    "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"[0-9]+\.[0-9]*|\.[0-9]+",
    "FLOAT": r"([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+",
    "SIGNED_FLOAT": r"[+-]?(([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)",
    "NUMBER": r"([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+([eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?(([0-9]+\.[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?|[0-9]+([eE][+-]?[0-9]+)?)",
    "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]",
    "LETTER": r"[a-zA-Z]",
    "WORD": r"[a-zA-Z]+",
    "CNAME": r"[a-zA-Z_][a-zA-Z0-9_]*",
    "WS_INLINE": r"[ \t]+",
    "WS": r"[ \t\f\r\n]+",
    "CR": r"\r",
    "LF": r"\n",
    "NEWLINE": r"(\r?\n)+",
    "ESCAPED_STRING": r'"([^"\\]|\\.)*"',
}

_NAME = r"[A-Za-z_][A-Za-z_0-9]*"
_DEFINITION = re.compile(rf"^(?P<inline>\?)?(?P<name>{_NAME})(?:\.-?\d+)?\s*:(?!:)(?P<body>.*)$")
_IMPORT = re.compile(rf"^%import\s+common\s*\.\s*(?P<name>{_NAME})(?:\s*->\s*(?P<alias>{_NAME}))?$")
_IMPORT_LIST = re.compile(r"^%import\s+common\s*\((?P<names>[^)]*)\)$")
_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')(?P<fold>i\b)?
    | /(?P<regex>(?:[^/\\\n]|\\.)+)/(?P<flags>[a-zA-Z]*)
    | (?P<range>\.\.)
    | (?P<alias>->\s*[A-Za-z_][A-Za-z_0-9]*)
    | (?P<number>\d+)
    | (?P<name>[A-Za-z_][A-Za-z_0-9]*)(?P<template>\{)?
    | (?P<op>[()\[\]|*+?~])
    )""",
    re.VERBOSE,
)


_COMMENT_OR_QUOTED = re.compile(r"""//|#|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|/(?:[^/\\\n]|\\.)+/""")


class LarkError(ValueError):
    """A Lark grammar this reader cannot write as EBNF; the message says where and why."""


def is_lark(grammar: str) -> bool:
    """Whether ``grammar`` reads as Lark: no line defines a rule with ``::=``."""
    return not any("::=" in _strip_comment(line) for line in grammar.splitlines())


def lark_to_ebnf(grammar: str) -> str:
    """The EBNF grammar of the same language as the Lark ``grammar`` (module doc)."""
    rules: dict[str, list[str]] = {}
    current: str | None = None
    for number, raw in enumerate(grammar.splitlines(), 1):
        line = _strip_comment(raw).strip()
        if not line:
            continue
        try:
            if line.startswith("%"):
                current = None
                for name, terminal in _directive(line):
                    rules.setdefault(name, [_regex(terminal)])
            elif line.startswith("|"):
                if current is None:
                    raise LarkError("an alternative '|' outside a rule")
                rules[current].append(_expression(line[1:]))
            elif (definition := _DEFINITION.match(line)) is not None:
                current = definition["name"]
                if current in rules:
                    raise LarkError(f"rule '{current}' is defined twice")
                body = definition["body"].strip()
                rules[current] = [_expression(body)] if body else []
            else:
                raise LarkError("expected 'name: ...', '| ...' or a %import")
        except LarkError as exc:
            raise LarkError(f"Lark grammar, line {number}: {exc}") from None
    if not rules:
        raise LarkError("Lark grammar: no rules")
    empty = [name for name, alternatives in rules.items() if not alternatives]
    if empty:
        raise LarkError(f"Lark grammar: rule '{empty[0]}' has no definition")
    root = "start" if "start" in rules else next(iter(rules))
    if root != "root" and "root" in rules:
        raise LarkError("Lark grammar: a rule named 'root' that is not the start rule")
    lines = [f"root ::= {root}"] if root != "root" else []
    lines += [f"{name} ::= {' | '.join(alternatives)}" for name, alternatives in rules.items()]
    return "\n".join(lines)


def _strip_comment(line: str) -> str:
    """``line`` without its ``//`` or ``#`` comment (outside strings and regexes)."""
    for match in _COMMENT_OR_QUOTED.finditer(line):
        if match.group() in ("//", "#"):
            return line[: match.start()]
    return line


def _directive(line: str) -> list[tuple[str, str]]:
    """The (rule name, regex) pairs a %import line brings."""
    if line.startswith("%ignore"):
        raise LarkError("%ignore has no EBNF form: write the whitespace into the rules")
    single = _IMPORT.match(line)
    if single is not None:
        names = [(single["alias"] or single["name"], single["name"])]
    elif (listed := _IMPORT_LIST.match(line)) is not None:
        names = [(name.strip(), name.strip()) for name in listed["names"].split(",")]
    else:
        raise LarkError(f"only '%import common.NAME' is supported, not {line!r}")
    unknown = [name for _, name in names if name not in COMMON_TERMINALS]
    if unknown:
        raise LarkError(f"common.{unknown[0]} is not one of {', '.join(COMMON_TERMINALS)}")
    return [(alias, COMMON_TERMINALS[name]) for alias, name in names]


def _expression(text: str) -> str:
    """One alternative list of a rule, written in EBNF."""
    out: list[str] = []
    closers: list[str] = []
    position = 0
    text = text.rstrip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None or match.end() == position:
            raise LarkError(f"cannot read {text[position:].strip()[:20]!r}")
        position = match.end()
        if match["string"] is not None:
            out.append(_string(_literal(match["string"]), folded=bool(match["fold"])))
        elif match["regex"] is not None:
            if match["flags"]:
                raise LarkError(f"regex flags ({match['flags']}) are not supported")
            out.append(_regex(match["regex"].replace("\\/", "/")))
        elif match["range"] is not None:
            _range(out, text, position)
            position = _TOKEN.match(text, position).end()
        elif match["alias"] is not None:
            continue
        elif match["name"] is not None:
            if match["template"]:
                raise LarkError(f"template rules ({match['name']}{{...}}) are not supported")
            out.append(match["name"])
        elif match["number"] is not None:
            raise LarkError(f"a number ({match['number']}) outside '~ n'")
        elif match["op"] in "([":
            out.append("(")
            closers.append(")" if match["op"] == "(" else ")?")
        elif match["op"] in ")]":
            expected = ")" if match["op"] == ")" else ")?"
            if not closers or closers.pop() != expected:
                raise LarkError(f"an unmatched {match['op']!r}")
            out.append(expected)
        elif match["op"] == "|":
            out.append("|")
        else:  # a postfix operator: it binds to the item before it
            if not out or out[-1] in ("(", "|"):
                raise LarkError(f"{match['op']!r} follows nothing")
            if match["op"] == "~":
                out[-1] += _repeat(text, position)
                position = _REPEAT.match(text, position).end()
            else:
                out[-1] += match["op"]
    if closers:
        raise LarkError("an unclosed '(' or '['")
    if not out:
        return '""'
    return " ".join(out)


_REPEAT = re.compile(r"\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def _repeat(text: str, position: int) -> str:
    match = _REPEAT.match(text, position)
    if match is None:
        raise LarkError("'~' needs a count: '~ n' or '~ n..m'")
    low, high = match.group(1), match.group(2)
    if high is not None and int(high) < int(low):
        raise LarkError(f"'~ {low}..{high}' counts down")
    return f"{{{low},{high}}}" if high is not None else f"{{{low}}}"


def _range(out: list[str], text: str, position: int) -> None:
    """Replace the string before ``..`` and the one after it with a character class."""
    after = _TOKEN.match(text, position)
    if not out or after is None or after["string"] is None:
        raise LarkError("'..' goes between two one-character strings")
    first, last = out.pop(), _literal(after["string"])
    first = json.loads(first) if first.startswith('"') else ""
    if len(first) != 1 or len(last) != 1:
        raise LarkError("'..' goes between two one-character strings")
    out.append(f"[{_class_char(first)}-{_class_char(last)}]")


def _literal(quoted: str) -> str:
    """The text of a Lark string (Python's escapes)."""
    try:
        return ast.literal_eval(quoted)
    except (SyntaxError, ValueError):
        raise LarkError(f"the string {quoted} does not read") from None


def _string(text: str, folded: bool) -> str:
    if not folded:
        return json.dumps(text, ensure_ascii=False)
    pieces = [
        f"[{_class_char(char.lower())}{_class_char(char.upper())}]"
        if char.lower() != char.upper()
        else json.dumps(char, ensure_ascii=False)
        for char in text
    ]
    return "(" + " ".join(pieces) + ")"


def _class_char(char: str) -> str:
    if char in "]\\-^[":
        return "\\" + char
    return json.dumps(char, ensure_ascii=False)[1:-1]


def _regex(pattern: str) -> str:
    return f"Regex({json.dumps(unroll_regex(pattern), ensure_ascii=False)})"
