"""Reading a checkpoint into a model: its config (model_config.py), HF safetensors weights
(loader.py) and GGUF files (gguf_loader.py). Errors the caller can name: errors.py."""
