"""`--tool-call-parser auto`: the format read from the model's chat template, as vLLM's recipes and
llama-server's `--jinja` pick one per model family. A template names its own tool-call markers:

| the template holds | format |
|---|---|
| `[TOOL_CALLS]` | `mistral` (Mistral, Mixtral, Nemo, Small, Devstral) |
| `<|python_start|>`, or a pythonic example `[func_name1(` | `pythonic` (Llama 4, Llama 3.2's pythonic variant) |
| `<|python_tag|>`, `<|start_header_id|>ipython`, or Llama's `"parameters": dictionary of argument` | `llama3_json` (Llama 3.1 / 3.2 / 3.3) |
| `<tool_call>` | `hermes` (Qwen2.5, Qwen3, Qwen2.5-Coder, Hermes 2/3, and most others) |
| none of those (SmolLM2's plain ChatML, a template that does not know tools) | `hermes`: such a template gets the Hermes system block as text, so the model answers in it |

The gateway resolves `auto` once per model pool, from the tokenizer that pool loaded (a GGUF's
template included), and says which it chose in its `tool_call_parser_selected` log line.
"""

from __future__ import annotations

from functools import lru_cache

from pagoda.runtime.logging import get_logger

log = get_logger(__name__)
AUTO = "auto"
# (marker in the template, parser name), checked in this order: the first marker found decides.
_MARKERS = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("[func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>ipython", "llama3_json"),
    ('"parameters": dictionary of argument', "llama3_json"),
    ("<tool_call>", "hermes"),
)
FALLBACK = "hermes"


def tool_parser_for_template(chat_template: str | dict | list | None) -> str:
    """The tool-call parser's name for a chat template (HF's several named templates: all of them read)."""
    text = _as_text(chat_template)
    for marker, name in _MARKERS:
        if marker in text:
            return name
    return FALLBACK


def selected_tool_parser(chat_template: str | dict | list | None) -> str:
    """`tool_parser_for_template`, remembered per template; the choice is logged once per template."""
    return _selected(_as_text(chat_template))


@lru_cache(maxsize=64)
def _selected(text: str) -> str:
    name = tool_parser_for_template(text)
    log.info("tool_call_parser_selected", parser=name, by="chat template" if text else "no chat template")
    return name


def _as_text(chat_template: str | dict | list | None) -> str:
    if isinstance(chat_template, dict):  # {name: template}
        return "\n".join(str(t) for t in chat_template.values())
    if isinstance(chat_template, list):  # [{"name", "template"}], tokenizer_config's older form
        return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in chat_template)
    return chat_template or ""
