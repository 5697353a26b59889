"""Issue 38: the Helm chart deploy/helm/codecage, rendered by real Helm (scripts/render-chart:
Helm's Go SDK from the locked helm-python-sdk wheel), every object strictly valid against the
Kubernetes 1.34 schemas offline (kubernetes-validate ships them), and the pod spec holding
what docs/kubernetes.md promises. No cluster runs here: what a kubelet and a CNI would do
with these objects is not tested (docs/kubernetes.md says so)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tests._kube import ROOT, by_kind, crd_validator, one, render, validate_builtin

from codecage import config

pytestmark = pytest.mark.timeout(300)

BUILTIN = {
    "ConfigMap",
    "Deployment",
    "HorizontalPodAutoscaler",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "Service",
    "ServiceAccount",
}
# Every optional part on at once: named clients, the PostgreSQL audit store, allowed hosts,
# the sessions StatefulSet, the queue-driven HPA, a ServiceMonitor without public metrics.
EVERYTHING = (
    "clients[0].name=ci",
    "clients[0].existingSecret=codecage-clients",
    "clients[0].runsPerMinute=120",
    "clients[0].maxConcurrent=2",
    "clients[1].name=alice-bot",
    "clients[1].existingSecret=codecage-clients",
    "clients[1].tokenKey=alice",
    "audit.mode=postgres",
    "audit.postgres.existingSecret=codecage-audit",
    "server.allowHosts={api.example.com,db.example.com:8443}",
    "sessions.statefulSet.enabled=true",
    "autoscaling.metric=queue",
    "metrics.public=false",
    "metrics.serviceMonitor.enabled=true",
)
SERVICE_MONITOR = ROOT / "tests" / "issues" / "crd_schemas" / "servicemonitor-v1.json"


def _pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o["spec"]["template"]["spec"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")
    ]


def _validate_all(objects: list[dict[str, Any]]) -> set[str]:
    kinds = set()
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":  # not Kubernetes': the Prometheus operator's CRD
            crd_validator(SERVICE_MONITOR).validate(obj)
        else:
            validate_builtin(obj)
        kinds.add(obj["kind"])
    return kinds


NARROW_SECCOMP = (
    "podSecurityContext.seccompProfile.type=Localhost",
    "podSecurityContext.seccompProfile.localhostProfile=codecage.json",
)


@pytest.mark.parametrize(
    "sets",
    [(), ("runtimeClassName=gvisor",), EVERYTHING, NARROW_SECCOMP],
    ids=["default", "gvisor", "all", "seccomp-localhost"],
)
def test_every_rendered_object_is_strictly_valid_kubernetes_1_34(sets: tuple[str, ...]) -> None:
    objects = render(*sets)
    kinds = _validate_all(objects)
    assert kinds >= BUILTIN
    if "runtimeClassName=gvisor" in sets:
        assert [p["runtimeClassName"] for p in _pods(objects)] == ["gvisor"]
    else:
        assert all("runtimeClassName" not in p for p in _pods(objects))
    if sets == EVERYTHING:
        assert kinds >= {"StatefulSet", "ServiceMonitor"}


def test_strict_validation_refuses_a_field_kubernetes_does_not_have() -> None:
    """The validator is not lenient: a misspelt field is an error, not dropped."""
    deployment = one(render(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilegd"] = False
    with pytest.raises(Exception, match="privilegd"):
        validate_builtin(deployment)


def test_the_pod_runs_unprivileged_as_non_root_with_probes_and_bounded_resources() -> None:
    for pod in _pods(render(*EVERYTHING)) + _pods(render()):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["hostUsers"] is False
        assert pod["automountServiceAccountToken"] is False
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc["privileged"] is False
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert "add" not in sc["capabilities"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
        assert "http" in ports
        assert f"--port={ports['http']}" in container["args"]
        for bound in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][bound])


def test_every_secret_comes_from_a_secret_key_ref_and_none_is_rendered() -> None:
    objects = render(*EVERYTHING)
    assert not by_kind(objects, "Secret")
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in container["env"]}
    refs = {n: e["valueFrom"]["secretKeyRef"] for n, e in env.items() if "valueFrom" in e}
    assert refs == {
        "CODECAGE_TOKEN": {"name": "codecage-token", "key": "token"},
        "CODECAGE_CLIENT_CI_TOKEN": {"name": "codecage-clients", "key": "ci"},
        "CODECAGE_CLIENT_ALICE_BOT_TOKEN": {"name": "codecage-clients", "key": "alice"},
        "CODECAGE_AUDIT": {"name": "codecage-audit", "key": "url"},
    }
    assert not any(
        a.startswith("--token") or a.startswith("--audit=post") for a in container["args"]
    )
    monitor = one(objects, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "codecage-token",
        "key": "token",
    }


def test_the_values_refuse_a_token_given_as_a_literal() -> None:
    """values.schema.json: a token value would end up in the release's stored values."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "render-chart"), "--set", "auth.token=hunter2"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "token" in proc.stderr


def test_codecage_reads_the_rendered_config_and_knows_every_rendered_flag(
    tmp_path: Path,
) -> None:
    """The ConfigMap's config.toml loads with codecage's own loader (the named clients and
    their token variables included), and `codecage serve` accepts every argument the pod
    passes (click rejects an unknown option before --help is acted on)."""
    objects = render(*EVERYTHING)
    toml = one(objects, "ConfigMap")["data"]["config.toml"]
    path = tmp_path / "config.toml"
    path.write_text(toml)
    path.chmod(0o444)
    settings = config.load(path, environ={})
    variables = {name: client.token_env for name, client in settings.serve.clients.items()}
    assert variables == {
        "ci": "CODECAGE_CLIENT_CI_TOKEN",
        "alice-bot": "CODECAGE_CLIENT_ALICE_BOT_TOKEN",
    }
    assert settings.serve.clients["ci"].runs_per_minute == 120
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    codecage = Path(sys.executable).parent / "codecage"
    proc = subprocess.run(
        [str(codecage), *container["args"], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_egress_unless_hosts_are_allowed_and_then_only_their_ports() -> None:
    policy = one(render(), "NetworkPolicy")
    assert "Egress" in policy["spec"]["policyTypes"]
    assert policy["spec"]["egress"] == []

    policy = one(render("server.allowHosts={api.example.com,db.example.com:8443}"), "NetworkPolicy")
    dns, out = policy["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert {p["port"] for p in out["ports"]} == {80, 443, 8443}
    (block,) = out["to"]
    assert "169.254.0.0/16" in block["ipBlock"]["except"]  # cloud metadata
    assert "10.0.0.0/8" in block["ipBlock"]["except"]

    policy = one(render("audit.mode=postgres", "audit.postgres.existingSecret=pg"), "NetworkPolicy")
    assert [p["port"] for r in policy["spec"]["egress"] for p in r["ports"]] == [53, 53, 5432]


def test_sessions_reach_the_pod_that_holds_them() -> None:
    objects = render("sessions.statefulSet.enabled=true")
    service = next(
        s for s in by_kind(objects, "Service") if not s["metadata"]["name"].endswith("-sessions")
    )
    assert service["spec"]["sessionAffinity"] == "ClientIP"
    sessions = one(objects, "StatefulSet")
    assert sessions["spec"]["replicas"] == 1
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    selected = [
        s
        for s in by_kind(objects, "Service")
        if s["spec"]["selector"].items()
        <= sessions["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in selected] == ["codecage-sessions"]


def test_scaling_and_disruption_and_metrics_scraping() -> None:
    objects = render()
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "replicas" not in one(objects, "Deployment")["spec"]  # the HPA owns it
    assert one(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert not by_kind(objects, "ServiceMonitor")  # auto, and no such CRD offline

    queue = one(render("autoscaling.metric=queue"), "HorizontalPodAutoscaler")
    metric = queue["spec"]["metrics"][0]["pods"]["metric"]["name"]
    # The name the server's /metrics really exports.
    from codecage.audit import metrics

    assert f'"{metric}"' in Path(metrics.__file__).read_text()


def test_the_chart_mirrors_the_containers_flags_and_neither_is_privileged() -> None:
    """deploy/podman.args lists what a container of the image needs (scripts/check-image runs
    one with exactly these); the chart's pod asks for the same, and neither for more."""
    flags = (ROOT / "deploy" / "podman.args").read_text().split()
    assert not any(
        f.startswith(("--privileged", "--cap-add", "--security-opt=label")) for f in flags
    )
    assert "--security-opt=unmask=ALL" in flags
    (seccomp,) = [f for f in flags if f.startswith("--security-opt=seccomp=")]
    profile = ROOT / seccomp.split("=", 2)[2]
    assert profile.is_file()
    (pod,) = _pods(render())
    (container,) = pod["containers"]
    assert container["securityContext"]["procMount"] == "Unmasked"  # unmask=ALL
    assert pod["securityContext"]["seccompProfile"]["type"] in ("Unconfined", "Localhost")
    (pod,) = _pods(render(*NARROW_SECCOMP))
    assert pod["securityContext"]["seccompProfile"] == {
        "type": "Localhost",
        "localhostProfile": profile.name,
    }
