"""Structured output: the constraint a request puts on what it generates.

A request names it in one of these ways (as OpenAI and vLLM accept them), on either endpoint:

- ``response_format``: ``{"type": "json_object"}`` (any JSON object), ``{"type":
  "json_schema", "json_schema": {"name": ..., "schema": {...}}}``, or a structural tag;
  ``{"type": "text"}`` is no constraint;
- ``structured_outputs``: an object with one of ``json`` (a schema), ``json_object``
  (true), ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) or
  ``structural_tag`` (a structural tag, or its JSON text), and vLLM's
  options: ``disable_any_whitespace`` (JSON with no whitespace but the separators'
  single spaces), and ``disable_additional_properties`` and ``disable_fallback``, which
  change nothing (a schema's objects never take properties it does not name; there is one
  backend);
- the older fields ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` and ``structural_tag``.

A structural tag leaves the text free until it writes one of the tag's triggers, and from
there holds it to a tag's begin string, content and end string. It is xgrammar's format,
``{"type": "structural_tag", "format": {...}}``, or the older one that vLLM also reads,
``{"type": "structural_tag", "structures": [{"begin", "schema", "end"}, ...], "triggers":
[...]}`` (each structure's content a JSON schema).

Here only the shapes are checked; the scheduler compiles the constraint (with the model's
vocabulary) and refuses, with a 400, one that does not compile.
"""

from __future__ import annotations

import json
from typing import Any

from frontend_proc import jsonutil
from frontend_proc.errors import invalid
from pegainfer.protocol import StructuredOutput

LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "structural_tag": "structural_tag",
}
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *LEGACY_FIELDS})
_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# Options of structured_outputs accepted as they change nothing here: a schema's objects
# never take properties it does not name, and there is one backend.
_NO_EFFECT = ("disable_additional_properties", "disable_fallback")


def parse_structured_output(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's constraint, or None. More than one is a 400."""
    found: list[tuple[str, StructuredOutput]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        constraint = _response_format(response_format)
        if constraint is not None:
            found.append(("response_format", constraint))
    structured = body.get("structured_outputs")
    if structured is not None:
        constraint = _structured_outputs(structured)
        if constraint is not None:
            found.append(("structured_outputs", constraint))
    for name, kind in LEGACY_FIELDS.items():
        value = body.get(name)
        if value is not None:
            found.append((name, _constraint(kind, value, name)))
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise invalid(f"a request may carry one output constraint, not {names}", found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise invalid("'response_format' must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("'response_format.json_schema' must be an object", param)
        schema = spec.get("schema")
        if schema is None:
            raise invalid("'response_format.json_schema.schema' is required", param)
        return _constraint("json", schema, param)
    if kind == "structural_tag":
        return _constraint("structural_tag", value, param)
    raise invalid(
        "'response_format.type' must be 'text', 'json_object', 'json_schema' or 'structural_tag'",
        param,
    )


def _structured_outputs(value: Any) -> StructuredOutput | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid("'structured_outputs' must be an object", param)
    given = [kind for kind in _KINDS if value.get(kind) not in (None, False)]
    options = (*_KINDS, *_NO_EFFECT, "disable_any_whitespace")
    unknown = [key for key, v in value.items() if key not in options and v not in (None, False)]
    if unknown:
        raise invalid(f"'structured_outputs.{unknown[0]}' is not supported", param)
    if len(given) > 1:
        raise invalid(f"'structured_outputs' may set one of {', '.join(_KINDS)}", param)
    if not given:
        return None
    constraint = _constraint(given[0], value[given[0]], param)
    compact = value.get("disable_any_whitespace")
    if compact not in (None, True, False):
        raise invalid("'structured_outputs.disable_any_whitespace' must be a boolean", param)
    constraint.compact_json = bool(compact) and constraint.kind in ("json", "json_object")
    return constraint


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json", json.dumps(_json_object(value, "JSON schema", param)))
    if kind == "json_object":
        if value is not True:
            raise invalid(f"'{param}.json_object' must be true", param)
        return StructuredOutput("json_object")
    if kind == "structural_tag":
        return StructuredOutput(kind, json.dumps(structural_tag(value, param)))
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise invalid(f"the choices in '{param}' must be a list of non-empty strings", param)
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise invalid(f"the {kind} in '{param}' must be a non-empty string", param)
    return StructuredOutput(kind, value)


def structural_tag(value: Any, param: str) -> dict[str, Any]:
    """The structural tag in ``value`` (an object or its JSON text), with ``"type":
    "structural_tag"``; its shape checked as far as which format it is in."""
    value = _json_object(value, "structural tag", param)
    tag = {"type": "structural_tag", **{key: v for key, v in value.items() if key != "type"}}
    if "structures" in tag:
        structures, triggers = tag.get("structures"), tag.get("triggers")
        if not isinstance(structures, list) or not structures:
            raise invalid(f"'{param}.structures' must be a non-empty list", param)
        for structure in structures:
            if not (
                isinstance(structure, dict)
                and isinstance(structure.get("begin"), str)
                and isinstance(structure.get("end"), str)
                and isinstance(structure.get("schema"), (dict, bool))
            ):
                raise invalid(
                    f"each of '{param}.structures' must be an object with a 'begin' and an "
                    "'end' string and a JSON 'schema'",
                    param,
                )
        if (
            not isinstance(triggers, list)
            or not triggers
            or not all(isinstance(trigger, str) and trigger for trigger in triggers)
        ):
            raise invalid(f"'{param}.triggers' must be a list of non-empty strings", param)
    elif not isinstance(tag.get("format"), dict):
        raise invalid(
            f"the structural tag in '{param}' needs a 'format' object, or 'structures' and "
            "'triggers'",
            param,
        )
    return tag


def _json_object(value: Any, what: str, param: str) -> dict[str, Any]:
    """``value``, an object or the JSON text of one."""
    if isinstance(value, str):
        try:
            value = jsonutil.loads(value)  # the body's own rules: no lone surrogates, bounded depth
        except ValueError as exc:
            raise invalid(f"the {what} in '{param}' is not JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise invalid(f"the {what} in '{param}' must be an object", param)
    return value
