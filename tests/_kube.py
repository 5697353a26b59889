"""What the Kubernetes tests share (issue 38): the chart rendered by scripts/render-chart (real
Helm: Helm's Go SDK from the locked helm-python-sdk), strict validation against Kubernetes'
own schemas (kubernetes-validate ships them; nothing is fetched), and strict validation of a
custom resource against the openAPIV3Schema of its CustomResourceDefinition, vendored as JSON.

Strict means what `kubectl apply --validate=strict` means: a field the schema does not name is
an error (the API server would otherwise drop it silently), as is a wrong type or a missing
required field.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = "1.34.0"


def render(*sets: str) -> list[dict[str, Any]]:
    """The chart's objects as scripts/render-chart prints them, each `--set KEY=VALUE` (a
    fresh copy each time: one run of Helm per set of values and test process)."""
    return copy.deepcopy(_rendered(sets))


@functools.cache
def _rendered(sets: tuple[str, ...]) -> list[dict[str, Any]]:
    argv = [sys.executable, str(ROOT / "scripts" / "render-chart")]
    for item in sets:
        argv += ["--set", item]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"{len(found)} {kind} objects rendered, not 1"
    return found[0]


def validate_builtin(obj: dict[str, Any]) -> None:
    """Raises: kubernetes_validate's ValidationError (or SchemaNotFoundError for a kind
    Kubernetes does not have)."""
    kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def crd_validator(schema_file: Path) -> jsonschema.protocols.Validator:
    """A JSON Schema validator for the custom resource a vendored CRD schema describes."""
    vendored = json.loads(schema_file.read_text())
    schema = _strict(copy.deepcopy(vendored["openAPIV3Schema"]))
    schema["properties"]["apiVersion"] = {"const": f"{vendored['group']}/{vendored['version']}"}
    schema["properties"]["kind"] = {"const": vendored["kind"]}
    schema["properties"]["metadata"] = _METADATA
    schema.setdefault("required", [])
    schema["required"] = sorted({*schema["required"], "apiVersion", "kind", "metadata"})
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    return cls(schema)  # type: ignore[no-any-return]


_METADATA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"},
        "namespace": {"type": "string"},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "additionalProperties": False,
}


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAPI v3 as Kubernetes reads it, turned into plain JSON Schema: `nullable` admits
    null, and an object with named properties admits no other (unless it says it keeps
    unknown fields or names additionalProperties)."""
    for key in ("properties", "patternProperties"):
        for sub in schema.get(key, {}).values():
            _strict(sub)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            _strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        for sub in schema.get(key, []):
            _strict(sub)
    if schema.pop("nullable", False) and "type" in schema:
        schema["type"] = [schema["type"], "null"]
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        schema["additionalProperties"] = False
    return schema
