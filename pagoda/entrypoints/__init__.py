"""The top layer, what users run: the offline `LLM` (and its beam search) and the launcher that
starts the whole stack. It may import every service; nothing below imports it."""
