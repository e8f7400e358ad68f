"""The top layer, what users run: the offline `LLM` (and its beam search), the launcher that
starts the whole stack, and the `pagoda` command on top of it (cli/: `pagoda serve`, `pagoda chat`).
It may import every service; nothing below imports it."""
