"""Command-line tools around the server: `default_model` (SmolLM2 from its PyPI wheel, `make
model`), `tiny_model` (the generated test model, `make tiny-model`) and `simulate` (the scheduler
against a fake worker, no model). Top layer: may import every service; nothing below imports it."""
