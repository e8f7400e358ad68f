"""Turn a CustomResourceDefinition's openAPIV3Schema into the strict JSON schema this folder vendors.

    python tests/k8s_schemas/extract_crd_schema.py CRD.yaml SOURCE_NOTE [--out tests/k8s_schemas]

writes one `KIND-GROUP-VERSION.json` per served version of the CRD. What changes on the way (the same
as kubeconform's openapi2jsonschema in strict mode, so an unknown field fails as on a real API server):
- every object that lists `properties` and says nothing of `additionalProperties` gets
  `additionalProperties: false`, unless it is `x-kubernetes-preserve-unknown-fields`;
- `x-kubernetes-int-or-string` becomes integer-or-string, `nullable` adds null to the type;
- `apiVersion` and `kind` are pinned to the CRD's, `description`s and the other `x-kubernetes-*`
  annotations (CEL rules no JSON-schema validator runs) are dropped: the files stay small.
The object's `metadata` stays open here: tests/k8s_tools.py checks it against the Kubernetes ObjectMeta.
`SOURCE_NOTE` (repository, tag, path, licence) goes into the file's `$comment`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


def strict(node: Any) -> Any:
    if isinstance(node, list):
        return [strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: strict(value) for key, value in node.items()
           if key != "description" and not key.startswith("x-kubernetes-") and key != "nullable"}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def schemas(crd: dict, note: str) -> dict[str, dict]:
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    found = {}
    for version in crd["spec"]["versions"]:
        if not version.get("served", True):
            continue
        schema = strict(version["schema"]["openAPIV3Schema"])
        schema["properties"]["apiVersion"] = {"const": f"{group}/{version['name']}"}
        schema["properties"]["kind"] = {"const": kind}
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema = {"$comment": note, **schema}
        found[f"{kind.lower()}-{group}-{version['name']}.json"] = schema
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("crd", type=Path)
    p.add_argument("note")
    p.add_argument("--out", type=Path, default=HERE)
    args = p.parse_args()
    crd = next(doc for doc in yaml.safe_load_all(args.crd.read_text()) if doc)
    for name, schema in schemas(crd, args.note).items():
        (args.out / name).write_text(json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n")
        print(args.out / name)


if __name__ == "__main__":
    main()
