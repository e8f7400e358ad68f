"""How many KV blocks fit in memory, and how many sequences that serves.

    python -m scheduler_svc.plan_capacity --num-layers 32 --num-kv-heads 8 --head-dim 128 \\
        --dtype float16 --block-size 16 --memory 60GiB [--seq-len 2048]
    python -m scheduler_svc.plan_capacity --model DIR --memory 60GiB   # reads DIR/config.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from pagoda.runtime.math_utils import cdiv

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_memory(text: str) -> int:
    """'60GiB', '512 MiB', '80GB' or a plain byte count -> bytes."""
    match = re.fullmatch(r"\s*([\d.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} (e.g. 60GiB, 80GB, 1024)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes  # K and V


def read_model_config(model_dir: str) -> dict[str, object]:
    """Layers, KV heads, head_dim and dtype from an HF config.json (defaults as transformers has them)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"num_layers": cfg["num_hidden_layers"],
            "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "dtype": str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")}


def capacity_lines(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str, block_size: int,
                   memory: int, seq_len: int) -> list[str]:
    per_token = bytes_per_token(num_layers, num_kv_heads, head_dim, DTYPE_BYTES[dtype])
    per_block = per_token * block_size
    num_blocks = memory // per_block
    blocks_per_seq = cdiv(seq_len, block_size)
    return [
        f"model: {num_layers} layers x {num_kv_heads} KV heads x head_dim {head_dim}, {dtype}",
        f"bytes per token:  {per_token:,}",
        f"bytes per block:  {per_block:,} (block size {block_size})",
        f"memory:           {memory:,} bytes",
        f"number of blocks: {num_blocks:,} ({num_blocks * block_size:,} token slots)",
        f"max concurrent sequences at {seq_len:,} tokens: {num_blocks // blocks_per_seq:,} "
        f"({blocks_per_seq} blocks each)",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="KV cache capacity planning")
    parser.add_argument("--model", help="HF model directory: read its config.json")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--num-kv-heads", type=int)
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--memory", type=parse_memory, required=True, help="KV cache memory, e.g. 60GiB")
    parser.add_argument("--seq-len", type=int, default=2048)
    args = parser.parse_args(argv)
    shape = read_model_config(args.model) if args.model else {}
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
        if getattr(args, name) is not None:
            shape[name] = getattr(args, name)
        if name not in shape:
            parser.error(f"--{name.replace('_', '-')} is required without --model")
    for line in capacity_lines(block_size=args.block_size, memory=args.memory, seq_len=args.seq_len,
                               **shape):  # type: ignore[arg-type]
        print(line)


if __name__ == "__main__":
    main()
