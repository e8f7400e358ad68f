"""deploy/: the alert rules, the Grafana dashboard and the Kubernetes manifests hang together.

- `promtool check rules` and `promtool test rules` on deploy/prometheus/ (skipped, saying so, where
  no promtool is installed: Debian's `prometheus` package has it);
- every PromQL expression (rules and dashboard panels) parses (promql-parser), and every series it
  names is one the gateway's real /metrics exposes (its registry, with the engine collector fed an
  EngineStats), or Prometheus' own `up`;
- every alert has a promtool test in which it fires;
- the Kubernetes manifests validate against the Kubernetes schemas (kubernetes-validate); the
  Prometheus Operator objects (CRDs, not in those schemas) are checked by hand: the ServiceMonitor
  selects the gateway Service's port, the PrometheusRule carries exactly alerts.yml's groups.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import METRICS
from pagoda.v1 import engine_pb2
from tests.prometheus_tools import prometheus_tool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/alerts.yml"
RULE_TESTS = ROOT / "deploy/prometheus/alerts.test.yml"
DASHBOARD = ROOT / "deploy/grafana/dashboards/pagoda.json"
K8S = ROOT / "deploy/k8s"
PROMETHEUS_OWN = {"up"}  # recorded by Prometheus per target, not exposed by anyone
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
            "summary": ("_count", "_sum", "_created"), "gauge": ("",)}


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def series_names(expr: str) -> set[str]:
    """The metric names an expression selects; raises ValueError when it does not parse."""
    grafana = expr.replace("$__rate_interval", "5m")  # Grafana's variable; $model sits in a label value
    names: set[str] = set()
    promql_parser.walk(promql_parser.parse(grafana),
                       lambda node: names.add(node.name) if isinstance(node, promql_parser.VectorSelector) else None)
    return names


@pytest.fixture(scope="module")
def exposed() -> set[str]:
    """Every sample name the gateway's /metrics can carry: its real registry rendered, with the
    engine's series from an EngineStats (labelled families with no child yet still have # TYPE)."""
    text = asyncio.run(METRICS.scrape(_stats)).decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


async def _stats():
    return engine_pb2.EngineStats(request_success={"stop": 1}, spec_accepted_per_pos=[1])


def test_the_exposition_has_what_the_alerts_are_about(exposed: set[str]) -> None:
    assert {"pagoda:brownout_active", "pagoda:engine_up", "vllm:num_requests_waiting",
            "vllm:time_to_first_token_seconds_bucket", "vllm:num_preemptions_total",
            "pagoda:http_requests_total"} <= exposed


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_series_named_exists_in_the_real_metrics(source: str, exposed: set[str]) -> None:
    exprs = [rule["expr"] for rule in alert_rules()] if source == "rules" else dashboard_exprs()
    assert exprs
    named = set().union(*(series_names(expr) for expr in exprs))
    assert named - exposed - PROMETHEUS_OWN == set()


def test_every_alert_fires_in_a_promtool_test_and_is_documented() -> None:
    names = [rule["alert"] for rule in alert_rules()]
    assert len(names) == len(set(names))
    firing = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for case in test["alert_rule_test"] if case.get("exp_alerts")}
    assert set(names) - firing == set()
    docs = (ROOT / "docs/observability.md").read_text()
    assert [name for name in names if f"`{name}`" not in docs] == []
    for rule in alert_rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert {"summary", "description"} <= set(rule["annotations"])


def test_promtool_checks_and_unit_tests_every_rule() -> None:
    promtool = prometheus_tool("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make prometheus-tools, or apt-get install prometheus): "
                    "rules not run through it")
    for args in (["check", "rules", RULES.name], ["test", "rules", RULE_TESTS.name]):
        done = subprocess.run([promtool, *args], cwd=RULES.parent, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


def test_the_dashboard_is_provisioned_with_its_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    source = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    [datasource] = source["datasources"]
    uids = {target["datasource"]["uid"] for panel in dashboard["panels"] for target in panel.get("targets", [])}
    assert uids == {datasource["uid"]} and datasource["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/pagoda.yml").read_text())
    [dashboards] = provider["providers"]
    grafana = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    assert mounts["./deploy/grafana/dashboards"] == dashboards["options"]["path"]
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]


def k8s_objects() -> list[dict]:
    files = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(files) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for name in files for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def test_kubernetes_manifests_validate_against_the_schemas() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    checked = 0
    for obj in k8s_objects():
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: test_prometheus_operator_objects
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
        checked += 1
    assert checked == 5


def by_kind(kind: str) -> list[dict]:
    return [obj for obj in k8s_objects() if obj["kind"] == kind]


def test_topology_gpus_and_probes() -> None:
    [engine] = by_kind("StatefulSet")
    containers = {c["name"]: c for c in engine["spec"]["template"]["spec"]["containers"]}
    assert containers["worker"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in containers["scheduler"]["resources"].get("limits", {})
    for name, port in (("worker", 50061), ("scheduler", 50052)):  # grpc.health.v1 on its own port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert containers[name][probe]["grpc"] == {"port": port}, (name, probe)
        command = containers[name]["command"]
        assert command[command.index("--port") + 1] == str(port)
    [gateway] = by_kind("Deployment")
    [container] = gateway["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    command = container["command"]
    engine_service = next(s for s in by_kind("Service") if s["metadata"]["name"] == engine["spec"]["serviceName"])
    pods = [f"{engine['metadata']['name']}-{i}.{engine_service['metadata']['name']}:50052"
            for i in range(engine["spec"]["replicas"])]  # every engine pod is one of its replicas
    assert command[command.index("--scheduler") + 1] == ",".join(pods)


def test_prometheus_operator_objects() -> None:
    [monitor], [rule] = by_kind("ServiceMonitor"), by_kind("PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    gateway = next(s for s in by_kind("Service") if s["metadata"]["name"] == "pagoda-gateway")
    labels = gateway["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in gateway["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert labels[monitor["spec"]["jobLabel"]] == "pagoda"  # job="pagoda", as the alerts expect


def test_the_schema_check_can_fail() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    [gateway] = by_kind("Deployment")
    gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/ready"
    with pytest.raises(kubernetes_validate.ValidationError, match="pth"):
        kubernetes_validate.validate(gateway, kubernetes_validate.latest_version(), strict=True)
    with pytest.raises(ValueError):
        series_names("rate(vllm:num_preemptions_total[5m]")  # the PromQL check can fail too
