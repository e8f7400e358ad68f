"""One shape for the parser registries (tool calls, reasoning): classes by their command-line name,
in registration order, as vLLM's `ToolParserManager` / `ReasoningParserManager` keep them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar


class ParserRegistry:
    """Subclass once per parser family: `class ToolParserManager(ParserRegistry, kind="tool-call parser")`.
    Each subclass gets its own `parsers` dict; a registered class gets its name as `.name`."""

    kind: ClassVar[str]
    parsers: ClassVar[dict[str, type]]

    def __init_subclass__(cls, kind: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind, cls.parsers = kind, {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type], type]:
        """Class decorator: register a parser class under `name` (vLLM's names)."""
        def register(parser: type) -> type:
            if name in cls.parsers:
                raise ValueError(f"{cls.kind} {name!r} is already registered")
            parser.name = name
            cls.parsers[name] = parser
            return parser
        return register

    @classmethod
    def get(cls, name: str) -> type:
        try:
            return cls.parsers[name]
        except KeyError:
            raise KeyError(f"no {cls.kind} {name!r} (known: {', '.join(cls.parsers)})") from None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.parsers)
