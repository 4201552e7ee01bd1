"""A request's `guided` field: one kind of constraint and its value, checked and put in canonical form.

The five kinds are those of vLLM's guided decoding: `json_schema` (a JSON Schema object),
`json_object` (any JSON object), `regex`, `choice` (a list of strings) and `grammar`. The canonical
value (a schema's compact JSON, keys in their order, which is the output's property order; a choice
list's JSON) is what the compiled-automaton cache is keyed by, so the same constraint compiles once.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jaxinfer.errors import RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GUIDED_CHARS = 1 << 16  # a schema's, pattern's or grammar's text
MAX_CHOICES = 256


@dataclass(frozen=True)
class GuidedSpec:
    """One constraint: `kind` (one of KINDS) and its canonical text."""

    kind: str
    value: str

    @property
    def key(self) -> str:
        """The content hash the compiled automaton is cached by."""
        return hashlib.sha256(f"{self.kind}\0{self.value}".encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """The batch line's form: {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}, ..."""
        if self.kind in ("json_schema", "choice"):
            return {self.kind: json.loads(self.value)}
        if self.kind == "json_object":
            return {"json_object": True}
        return {self.kind: self.value}

    @property
    def choices(self) -> list[str]:
        return json.loads(self.value) if self.kind == "choice" else []


def guided_spec(value: object) -> GuidedSpec | None:
    """A `guided` field as given (None, a GuidedSpec, or a one-key mapping) -> its spec; RequestError
    naming `guided.<kind>` and the limit for anything else."""
    if value is None or isinstance(value, GuidedSpec):
        return value
    if not isinstance(value, Mapping):
        raise RequestError(f"guided: must be an object with one of {', '.join(KINDS)}, got {type(value).__name__}")
    kinds = [k for k, v in value.items() if v is not None]
    if not kinds:
        return None
    if len(kinds) != 1 or kinds[0] not in KINDS:
        raise RequestError(f"guided: exactly one of {', '.join(KINDS)}, got {sorted(map(str, kinds))}")
    kind = kinds[0]
    return GuidedSpec(kind, _CANONICAL[kind](value[kind]))


def _schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise RequestError(f"guided.json_schema: not valid JSON ({error})") from None
    if not isinstance(schema, Mapping):
        raise RequestError(f"guided.json_schema: must be a JSON Schema object, got {type(schema).__name__}")
    return _limited("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def _json_object(flag: object) -> str:
    if flag is not True:
        raise RequestError(f"guided.json_object: must be true, got {flag!r:.40}")
    return ""


def _text(kind: str):
    def check(text: object) -> str:
        if not isinstance(text, str) or not text:
            raise RequestError(f"guided.{kind}: must be a non-empty string")
        return _limited(kind, text)

    return check


def _choice(choices: object) -> str:
    if not isinstance(choices, list | tuple) or not choices:
        raise RequestError("guided.choice: must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise RequestError(f"guided.choice: at most {MAX_CHOICES} strings, got {len(choices)}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise RequestError(f"guided.choice[{i}]: must be a non-empty string")
    return _limited("choice", json.dumps(list(choices), ensure_ascii=False))


def _limited(kind: str, text: str) -> str:
    if len(text) > MAX_GUIDED_CHARS:
        raise RequestError(f"guided.{kind}: at most {MAX_GUIDED_CHARS} characters, got {len(text)}")
    return text


_CANONICAL = {"json_schema": _schema, "json_object": _json_object, "regex": _text("regex"), "choice": _choice,
              "grammar": _text("grammar")}
