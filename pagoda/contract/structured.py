"""Structured outputs: what a request asks its output to match, and that spec as a grammar.

`StructuredOutputsParams` is vLLM's (exactly one of json, regex, choice, grammar, json_object). The
gateway validates a spec once when the request arrives (a bad schema is a 400 before admission);
the worker compiles it for the tokenizer and masks the logits of every step with it
(worker_svc/structured_output.py). Both turn a spec into the same llguidance grammar here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from pagoda.contract.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Compact, deterministic JSON: no free whitespace a small model could run away in.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Exactly one field set. `json` is a JSON schema (dict or its text; kept as canonical text)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF (`::=` rules)
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as error:
                    raise InvalidRequestError(f"structured outputs: json is not valid JSON: {error}") from None
            if not isinstance(schema, dict | bool):
                raise InvalidRequestError("structured outputs: json must be a JSON schema object")
            object.__setattr__(self, "json", json.dumps(schema, sort_keys=True))
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(str(c) for c in self.choice))
            if not self.choice:
                raise InvalidRequestError("structured outputs: choice must not be empty")
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"structured outputs: set exactly one of {', '.join(KINDS)} (got {chosen or 'none'})")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The value of the one kind set, as text (choice: a JSON list)."""
        value = getattr(self, self.kind)
        return json.dumps(list(value)) if self.kind == "choice" else "" if value is True else value

    @staticmethod
    def from_kind(kind: str, spec: str) -> StructuredOutputsParams:
        """Inverse of (kind, spec): what the wire carries."""
        if kind not in KINDS:
            raise InvalidRequestError(f"structured outputs: unknown kind {kind!r}")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "choice":
            return StructuredOutputsParams(choice=tuple(json.loads(spec)))
        return StructuredOutputsParams(**{kind: spec})


def to_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (text) of a spec; validity is checked by `check_grammar`."""
    return _grammar(params.kind, params.spec)


@lru_cache(maxsize=1024)
def _grammar(kind: str, spec: str) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind in ("json", "json_object"):
        schema = json.loads(spec) if kind == "json" else {"type": "object"}
        return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in json.loads(spec)))
    return LLMatcher.grammar_from_lark(any_to_lark(spec))  # GBNF (vLLM's EBNF) or Lark


@lru_cache(maxsize=1024)
def grammar_error(grammar: str) -> str:
    """'' when the grammar compiles, else llguidance's message (cached: a schema sent again is free)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


def check_grammar(params: StructuredOutputsParams) -> None:
    """400 (InvalidRequestError) when the spec does not compile (bad schema, regex or grammar)."""
    try:
        error = grammar_error(to_grammar(params))
    except Exception as exc:  # noqa: BLE001 - llguidance's converters raise their own types
        error = str(exc) or type(exc).__name__
    if error:
        raise InvalidRequestError(f"structured outputs: invalid {params.kind}: {error}")
