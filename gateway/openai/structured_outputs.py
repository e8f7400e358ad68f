"""The request fields that ask for structured outputs, in each spelling clients use:

- OpenAI's `response_format`: `{"type": "text"}`, `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs`: `{"json" | "regex" | "choice" | "grammar" | "json_object": ...}`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one may ask for a constraint; each becomes a `StructuredOutputsParams` (pagoda.contract).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.contract.errors import InvalidRequestError
from pagoda.contract.structured import StructuredOutputsParams


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always matches the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint asked for (None: free text); 400 when several are, or none is valid."""
        asked: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked["response_format"] = StructuredOutputsParams(json_object=True)
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise InvalidRequestError("response_format: json_schema.schema is required")
            asked["response_format"] = StructuredOutputsParams(json=rf.json_schema.json_schema)
        so = self.structured_outputs
        if so is not None:
            asked["structured_outputs"] = StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=tuple(so.choice) if so.choice is not None else None,
                grammar=so.grammar, json_object=bool(so.json_object))
        legacy = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
        for name, kind in legacy.items():
            value = getattr(self, name)
            if value is not None:
                asked[name] = StructuredOutputsParams(**{kind: tuple(value) if kind == "choice" else value})
        if len(asked) > 1:
            raise InvalidRequestError(f"ask for one structured output, not {len(asked)}: {', '.join(asked)}")
        return next(iter(asked.values()), None)
