"""What `--model` names, for every process: an HF-format directory or a llama.cpp `.gguf` file.

Shared by the worker's loader, the gateway, the offline `LLM` and `pagoda.tools.default_model`, so every
reader of a model path accepts the same two formats.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from pagoda.runtime.logging import get_logger

log = get_logger(__name__)


def is_gguf_file(path: str | Path) -> bool:
    path = Path(path)
    return path.suffix == ".gguf" and path.is_file()


def load_tokenizer(model: str | Path, **kwargs: Any) -> Any:
    """The model's HF tokenizer; for a GGUF, transformers converts the file's tokenizer metadata
    (vocabulary, merges, special tokens, chat template), once per file: the conversion is saved
    under the tokenizer cache (`tokenizer_cache_dir`) and later loads read that."""
    from transformers import AutoTokenizer  # slow import: only when text is involved

    if not is_gguf_file(model):
        return AutoTokenizer.from_pretrained(model, **kwargs)
    cached = _cached_tokenizer_dir(Path(model))
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        # The generic class runs the saved tokenizer.json as it is; AutoTokenizer would pick a
        # model's class (Qwen2Tokenizer) that rebuilds its own pre-tokenizer and splits differently.
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(cached, **kwargs)
    tokenizer = _convert_gguf_tokenizer(Path(model), **kwargs)
    if cached is not None and not kwargs:
        _save_atomically(tokenizer, cached)
    return tokenizer


def _convert_gguf_tokenizer(path: Path, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    except ValueError as error:  # "GGUF model with architecture olmo2 is not supported yet."
        if "architecture" not in str(error):
            raise
    # AutoTokenizer parses the file's model config to pick a tokenizer class, which transformers
    # does for some GGUF architectures only (not OLMo 2, OLMoE or Granite); the tokenizer itself
    # converts from the metadata alone, into the same class AutoTokenizer gives a Llama GGUF.
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name, **kwargs)


def tokenizer_cache_dir() -> Path | None:
    """Where converted GGUF tokenizers are kept: $PAGODA_TOKENIZER_CACHE, else
    $XDG_CACHE_HOME/pagoda/tokenizers (~/.cache/...). Set the variable to "" to convert every time."""
    configured = os.environ.get("PAGODA_TOKENIZER_CACHE")
    if configured is not None:
        return Path(configured) if configured else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagoda" / "tokenizers"


def _cached_tokenizer_dir(path: Path) -> Path | None:
    # Keyed by the file (resolved path, size, mtime) and the transformers version that converts:
    # a rewritten file or another converter is converted afresh, never served a stale vocabulary.
    root = tokenizer_cache_dir()
    if root is None:
        return None
    import transformers

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _save_atomically(tokenizer: Any, target: Path) -> None:
    """Save into a temporary sibling and rename it into place, so a reader (another service
    starting at the same moment) sees a whole directory or none; a cache that cannot be written
    (read-only home in a container) only costs the next start its conversion."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".partial-") as partial:
            tokenizer.save_pretrained(partial)
            try:
                os.rename(partial, target)
            except OSError:  # another process finished first: theirs is the same conversion
                pass
    except OSError as error:
        log.warning("tokenizer_cache_unwritable", path=str(target), error=str(error))
