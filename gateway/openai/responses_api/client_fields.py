"""What agent clients (Codex CLI, the Agents SDK) send on /v1/responses beyond the fields every
server serves, and the documented choice for each (docs/gateway.md#responses-api):

- **Built-in tools** (`web_search`, `file_search`, `code_interpreter`, `computer_use_preview`,
  `image_generation`, `local_shell`, `mcp`, `custom`, `namespace`, ... any `type` but `function`):
  accepted and *not offered to the model*: Pagoda runs none of them, and a model offered a tool that
  nobody runs would call it. Only function tools reach the prompt. A tool_choice naming one of them
  is a 400; so is a request whose tool_choice is "required" while no function tool is left.
- **include**: values about tools Pagoda never runs or inputs it never takes (`web_search_call.*`,
  `file_search_call.results`, `code_interpreter_call.outputs`, `computer_call_output.output.image_url`,
  `message.input_image.image_url`) and `reasoning.encrypted_content` (Pagoda's reasoning items carry
  their text; reasoning sent back is accepted either way) are ignored: nothing they would add exists.
  `message.output_text.logprobs` and unknown values are a 400 (the client would miss what it asked for).
- **reasoning**: `effort` "none" / "minimal" turns a template's thinking off (`enable_thinking: false`,
  Qwen3's switch; templates without it ignore it); other efforts are ignored (a served model thinks as
  its template says). `summary` / `generate_summary` are ignored: Pagoda writes no summaries, the
  thinking itself is the reasoning item's `reasoning_text` (with --reasoning-parser).
- **text.verbosity**: ignored (a hint the served models have no control for).
- **client_metadata**, `prompt_cache_key`, `prompt_cache_retention`, `metadata`, `user`,
  `safety_identifier`, `service_tier`: informational, they change no output.

Every ignored field present in a request is named in one debug log line (`request_fields_ignored`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

INCLUDE_IGNORED = frozenset({
    "reasoning.encrypted_content", "web_search_call.action.sources", "web_search_call.results",
    "file_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "message.input_image.image_url",
})
THINKING_OFF_EFFORTS = ("none", "minimal")


class BuiltinTool(BaseModel):
    """A tool of any type but `function`: accepted, echoed, not offered to the model."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # none / minimal: thinking off; any other (low ... xhigh, and efforts OpenAI adds later): ignored
    effort: str | None = None
    summary: Literal["auto", "concise", "detailed", "none"] | None = None
    generate_summary: Literal["auto", "concise", "detailed", "none"] | None = None  # the older name

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": False} if self.effort in THINKING_OFF_EFFORTS else {}


def tool_type(tool: Any) -> str:
    """The tool union's discriminator: function tools, and every other type."""
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return "function" if kind == "function" else "builtin"


def check_include(values: list[str] | None) -> list[str] | None:
    refused = [v for v in values or () if v not in INCLUDE_IGNORED]
    if refused:
        raise PydanticCustomError("unsupported_include", "include values not served: {refused} (accepted and "
                                  "ignored: {ignored})", {"refused": ", ".join(map(str, refused)),
                                                          "ignored": ", ".join(sorted(INCLUDE_IGNORED))})
    return values


def ignored_fields(body: Any) -> list[str]:
    """The fields of a ResponsesRequest that are accepted and ignored (for the debug log)."""
    names = [f"tools[type={t.type}]" for t in body.tools or () if isinstance(t, BuiltinTool)]
    names += [f"include={v}" for v in body.include or ()]
    reasoning = body.reasoning
    if reasoning is not None:
        if reasoning.effort is not None and reasoning.effort not in THINKING_OFF_EFFORTS:
            names.append(f"reasoning.effort={reasoning.effort}")
        names += [f"reasoning.{k}" for k in ("summary", "generate_summary") if getattr(reasoning, k) is not None]
    if body.text is not None and body.text.verbosity is not None:
        names.append("text.verbosity")
    return names
