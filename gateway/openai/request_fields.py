"""The one table of request fields for /v1/completions and /v1/chat/completions.

Every field of OpenAI's request schemas is here, with what the gateway does with it:

- HONOURED: changes the output as OpenAI documents (declared on the pydantic models and used);
- INFORMATIONAL: accepted, and by definition changes no output (`user`, `metadata`, cache keys);
- CONDITIONAL: accepted only with the values listed (the default); any other value is a 400 that
  names the field, because serving it would silently differ from what the client asked for.

A field that is neither OpenAI's nor one of vLLM's extras the models declare is a 400 too
(pydantic's `extra="forbid"`). tests/gateway/test_openai_fields.py enumerates OpenAI's schemas
from the installed `openai` client and checks each field against this table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic_core import PydanticCustomError


def _absent(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


def _unsupported(why: str) -> tuple[Callable[[Any], bool], str]:
    return _absent, f"not supported: {why}"


# field -> (is the value acceptable?, the 400 message otherwise)
CONDITIONAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    # completions
    "suffix": _unsupported("Pagoda serves no fill-in-the-middle"),
    # chat
    "audio": _unsupported("text output only"),
    "modalities": (lambda v: _absent(v) or list(v) == ["text"], "only [\"text\"] is supported"),
    "functions": _unsupported("the deprecated functions are not served; use tools"),
    "function_call": (lambda v: _absent(v) or v == "none", "the deprecated function_call is not served; use tool_choice"),
    "prediction": _unsupported("predicted outputs are not implemented"),
    "reasoning_effort": _unsupported("the served models do not reason"),
    "verbosity": _unsupported("the served models have no verbosity setting"),
    "web_search_options": _unsupported("Pagoda does no web search"),
    "moderation": _unsupported("Pagoda runs no moderation"),
    "store": (lambda v: not v, "store=true is not supported: Pagoda stores no completions"),
}

# Accepted and used (both endpoints share most of them; vLLM's extras are listed in the models).
HONOURED_COMPLETION = frozenset({
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "best_of",  # the beam width with vLLM's use_beam_search (a 400 otherwise: see the model)
    "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature", "top_p",
}) - CONDITIONAL.keys()
HONOURED_CHAT = frozenset({
    "model", "messages", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "temperature",
    "top_logprobs", "top_p", "response_format", "tools", "tool_choice", "parallel_tool_calls",
}) - CONDITIONAL.keys()
# Accepted; they change no output by definition (identifiers, billing tiers, cache hints: the
# prefix cache is automatic and keeps what fits).
INFORMATIONAL = frozenset({
    "user", "metadata", "safety_identifier", "service_tier", "prompt_cache_key",
    "prompt_cache_options", "prompt_cache_retention",
})


def check_conditional(name: str, value: Any) -> Any:
    """The validator of every CONDITIONAL field: the value back, or a 400 naming the field."""
    acceptable, message = CONDITIONAL[name]
    try:
        ok = acceptable(value)
    except (TypeError, ValueError, AttributeError):  # a value of the wrong shape is not the default
        ok = False
    if not ok:
        raise PydanticCustomError("unsupported_field", message)
    return value
