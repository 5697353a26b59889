"""Issue 38: the agent-sandbox manifests (deploy/agent-sandbox: a SandboxTemplate that runs
codecage, a SandboxWarmPool of it, a SandboxClaim) validate strictly against the v1beta1
openAPIV3Schema of kubernetes-sigs/agent-sandbox's CRDs, vendored in deploy/agent-sandbox/
schemas (README.md there names their source commit), and the template's pod spec is a valid
Kubernetes 1.34 PodSpec holding the chart's security settings. No agent-sandbox controller
runs here: that a claim really gets a pod is not tested."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from tests._kube import ROOT, crd_validator, validate_builtin

pytestmark = pytest.mark.timeout(120)

HERE = ROOT / "deploy" / "agent-sandbox"
MANIFESTS = {
    "sandboxtemplate.yaml": "sandboxtemplate-v1beta1.json",
    "sandboxwarmpool.yaml": "sandboxwarmpool-v1beta1.json",
    "sandboxclaim.yaml": "sandboxclaim-v1beta1.json",
}


def _load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((HERE / name).read_text())
    return doc


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_each_manifest_is_valid_against_its_crd_schema(manifest: str) -> None:
    crd_validator(HERE / "schemas" / MANIFESTS[manifest]).validate(_load(manifest))


def test_the_crd_validation_is_strict() -> None:
    """A field the CRD does not name is refused, not pruned as the API server would."""
    import jsonschema

    template = _load("sandboxtemplate.yaml")
    template["spec"]["warmPool"] = 3
    validator = crd_validator(HERE / "schemas" / "sandboxtemplate-v1beta1.json")
    with pytest.raises(jsonschema.ValidationError, match="warmPool"):
        validator.validate(template)
    pool = _load("sandboxwarmpool.yaml")
    pool["spec"]["replicas"] = "three"
    with pytest.raises(jsonschema.ValidationError, match="three"):
        crd_validator(HERE / "schemas" / "sandboxwarmpool-v1beta1.json").validate(pool)


def test_the_template_pod_is_a_valid_unprivileged_codecage_server() -> None:
    template = _load("sandboxtemplate.yaml")
    pod_spec = template["spec"]["podTemplate"]["spec"]
    validate_builtin(
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "codecage"}, "spec": pod_spec}
    )
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    assert pod_spec["hostUsers"] is False
    (container,) = pod_spec["containers"]
    assert container["args"][:2] == ["serve", "--http"]
    assert container["securityContext"]["privileged"] is False
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    token = next(e for e in container["env"] if e["name"] == "CODECAGE_TOKEN")
    assert set(token) == {"name", "valueFrom"}
    assert "secretKeyRef" in token["valueFrom"]
    # Default deny: an empty egress list is agent-sandbox's "all egress blocked".
    assert template["spec"]["networkPolicy"]["egress"] == []
    assert template["spec"]["envVarsInjectionPolicy"] == "Disallowed"


def test_the_pool_and_claim_point_at_the_template() -> None:
    template = _load("sandboxtemplate.yaml")["metadata"]["name"]
    pool = _load("sandboxwarmpool.yaml")
    assert pool["spec"]["sandboxTemplateRef"]["name"] == template
    assert _load("sandboxclaim.yaml")["spec"]["warmPoolRef"]["name"] == pool["metadata"]["name"]


def test_the_vendored_schemas_name_their_source() -> None:
    for schema in (HERE / "schemas").glob("*.json"):
        assert "2fd412d55ecae90861a101a5424a75473de97c36" in schema.read_text()[:400]
    assert Path(HERE / "README.md").read_text().count("2fd412d55ecae90861a101a5424a75473de97c36")
