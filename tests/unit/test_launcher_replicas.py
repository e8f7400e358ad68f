"""The launcher's --data-parallel-size: N worker + scheduler pairs on offset ports, one gateway;
--extra-model: one more pair per model, a named pool at the gateway."""

from __future__ import annotations

import os

import pytest

from pagoda.entrypoints.launcher.cli import parse_args
from pagoda.entrypoints.launcher.topology import build_children, replica_devices, taken_ports


def test_two_replicas_get_offset_ports_and_one_gateway_over_both():
    args = parse_args(["--fake", "--data-parallel-size", "2", "--worker-port", "30061",
                       "--scheduler-port", "30052", "--routing-policy", "round-robin"])
    children = build_children(args)
    names = [c.name for c in children]
    assert names[:4] == ["worker[0]", "scheduler[0]", "worker[1]", "scheduler[1]"]
    assert [c.health_target for c in children[:4]] == ["127.0.0.1:30061", "127.0.0.1:30052",
                                                       "127.0.0.1:30071", "127.0.0.1:30062"]
    assert children[3].argv[children[3].argv.index("--workers") + 1] == "127.0.0.1:30071"
    if names[-1] == "gateway":
        argv = children[-1].argv
        assert argv[argv.index("--scheduler") + 1] == "127.0.0.1:30052,127.0.0.1:30062"
        assert argv[argv.index("--routing-policy") + 1] == "round-robin"


def test_one_replica_keeps_the_plain_names_and_flags():
    children = build_children(parse_args(["--fake"]))
    assert [c.name for c in children][:2] == ["worker", "scheduler"]
    assert all(c.env == {} for c in children)


def test_the_disk_tier_gets_one_folder_per_replica():
    """Each worker locks its disk tier's folder: data-parallel replicas of one model get their own."""
    flags = ["--fake", "--kv-offloading-size", "1", "--kv-offload-dir", "/var/kv", "--kv-offload-dir-size", "2"]

    def disk_flags(children):
        return [c.argv[c.argv.index("--kv-offload-dir"):c.argv.index("--kv-offload-dir") + 4]
                for c in children if c.name.startswith("worker")]

    assert disk_flags(build_children(parse_args(flags))) == [["--kv-offload-dir", "/var/kv", "--kv-offload-dir-size", "2.0"]]
    assert disk_flags(build_children(parse_args([*flags, "--data-parallel-size", "2"]))) == [
        ["--kv-offload-dir", f"/var/kv/replica-{i}", "--kv-offload-dir-size", "2.0"] for i in range(2)]


def test_each_replica_sees_its_own_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    args = parse_args(["--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    assert [replica_devices(args, i) for i in range(2)] == [{"CUDA_VISIBLE_DEVICES": "4,5"},
                                                            {"CUDA_VISIBLE_DEVICES": "6,7"}]
    cores = str(max(1, (os.cpu_count() or 1) // 2))  # CPU replicas share the host's cores
    assert replica_devices(parse_args(["--data-parallel-size", "2", "--device", "cpu"]), 1) == {"OMP_NUM_THREADS": cores}


def test_every_replica_port_is_checked_before_starting():
    import socket

    with socket.socket() as occupant:
        occupant.bind(("127.0.0.1", 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        args = parse_args(["--fake", "--no-gateway", "--data-parallel-size", "2",
                           "--worker-port", str(port - 10)])
        assert taken_ports(args) == [f"--worker-port + 10 {port}"]


def test_an_extra_model_is_one_more_pair_and_a_named_pool_at_the_gateway(monkeypatch):
    args = parse_args(["--fake", "--worker-port", "30061", "--scheduler-port", "30052",
                       "--extra-model", "models/other.gguf", "--extra-model", "small=models/x",
                       "--fallback-model", "big=small"])
    children = build_children(args)
    assert [c.name for c in children][:6] == ["worker[0]", "scheduler[0]", "worker[1]", "scheduler[1]",
                                              "worker[2]", "scheduler[2]"]
    assert [c.health_target for c in children[1:6:2]] == ["127.0.0.1:30052", "127.0.0.1:30062",
                                                          "127.0.0.1:30072"]
    if children[-1].name == "gateway":
        argv = children[-1].argv
        assert argv[argv.index("--scheduler") + 1] == ("127.0.0.1:30052,other=127.0.0.1:30062,"
                                                       "small=127.0.0.1:30072")
        assert argv[argv.index("--fallback-model") + 1] == "big=small"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert replica_devices(args, 2) == {"CUDA_VISIBLE_DEVICES": "2"}


def test_the_reasoning_and_timings_flags_reach_the_gateway():
    from gateway.__main__ import parse_args as gateway_args
    from gateway.openai.reasoning_parsers import ReasoningParserManager

    children = build_children(parse_args(["--fake", "--reasoning-parser", "qwen3", "--enable-request-timings"]))
    gateway = children[-1]
    assert gateway.name == "gateway"
    config = gateway_args(gateway.argv[gateway.argv.index("--scheduler"):])
    assert config.reasoning_parser == "qwen3" and config.enable_request_timings
    plain = build_children(parse_args(["--fake"]))[-1].argv
    assert "--reasoning-parser" not in plain and "--enable-request-timings" not in plain
    # The launcher lists the gateway's formats without importing it: the lists must agree.
    choices = next(a.choices for a in _launcher_parser()._actions if a.dest == "reasoning_parser")
    assert tuple(choices) == ReasoningParserManager.names()


def _launcher_parser():
    import argparse

    from pagoda.entrypoints.launcher.cli import add_flags, add_groups

    parser = argparse.ArgumentParser()
    add_flags(add_groups(parser))
    return parser


def test_pooling_flags_reach_the_worker_only_when_they_differ_from_its_defaults():
    worker = build_children(parse_args(["--fake"]))[0].argv
    assert "--pooling-type" not in worker and "--no-normalize-embeddings" not in worker
    worker = build_children(parse_args(["--fake", "--pooling-type", "mean", "--no-normalize-embeddings"]))[0].argv
    assert worker[-3:] == ["--pooling-type", "mean", "--no-normalize-embeddings"]


def test_quantization_reaches_the_worker_only_when_asked_for():
    worker = build_children(parse_args(["--fake"]))[0].argv
    assert "--quantization" not in worker  # auto: the worker's default
    worker = build_children(parse_args(["--fake", "--quantization", "int8"]))[0].argv
    assert worker[worker.index("--quantization") + 1] == "int8"
    from worker_svc.__main__ import build_config
    from worker_svc.__main__ import parse_args as worker_args

    assert build_config(worker_args(worker[1:])).quantization == "int8"


def test_every_replica_shares_the_one_migration_folder():
    children = build_children(parse_args(["--fake", "--data-parallel-size", "2", "--kv-migrate-dir", "/var/mig"]))
    workers = [c for c in children if "--kv-migrate-dir" in c.argv]
    assert len(workers) == 2 and all(c.argv[c.argv.index("--kv-migrate-dir") + 1] == "/var/mig" for c in workers)
    assert not any("--kv-migrate-dir" in c.argv for c in build_children(parse_args(["--fake"])))


def test_every_replica_shares_the_one_session_snapshot_folder():
    children = build_children(parse_args(["--fake", "--data-parallel-size", "2", "--kv-snapshot-dir", "/var/snap"]))
    workers = [c for c in children if "--kv-snapshot-dir" in c.argv]
    assert len(workers) == 2 and all(c.argv[c.argv.index("--kv-snapshot-dir") + 1] == "/var/snap" for c in workers)
    assert not any("--kv-snapshot-dir" in c.argv for c in build_children(parse_args(["--fake"])))


def test_host_moves_only_the_gateway():
    """`--host 0.0.0.0` (a pod behind a Service: deploy/k8s/multihost) binds the gateway there; the
    worker and the scheduler stay on loopback, and the default stays 127.0.0.1."""
    def gateway_host(children):
        [gateway] = [c for c in children if c.name == "gateway"]
        return gateway.argv[gateway.argv.index("--host") + 1]

    children = build_children(parse_args(["--fake", "--host", "0.0.0.0"]))
    assert gateway_host(children) == "0.0.0.0"
    assert all("--host" not in c.argv for c in children if c.name != "gateway")
    assert gateway_host(build_children(parse_args(["--fake"]))) == "127.0.0.1"


def test_grpc_transport_reaches_every_worker_and_each_advertises_its_own_port():
    from worker_svc.__main__ import build_config
    from worker_svc.__main__ import parse_args as worker_args

    children = build_children(parse_args(["--data-parallel-size", "2", "--kv-transfer", "grpc"]))
    workers = [c for c in children if c.argv[0] == "worker_svc"]
    assert len(workers) == 2 and all("--kv-transfer" in c.argv and "--kv-migrate-dir" not in c.argv for c in workers)
    configs = [build_config(worker_args(c.argv[1:])) for c in workers]
    assert [c.kv_transfer for c in configs] == ["grpc", "grpc"]
    ports = [c.argv[c.argv.index("--port") + 1] for c in workers]
    assert [c.kv_transfer_address for c in configs] == [f"127.0.0.1:{p}" for p in ports]
    with pytest.raises(SystemExit, match="needs none"):
        build_config(worker_args(["--model", "m", "--kv-transfer", "grpc", "--kv-migrate-dir", "/x"]))
    assert build_config(worker_args(["--model", "m", "--host", "0.0.0.0", "--kv-transfer", "grpc"])
                        ).kv_transfer_address.endswith(":50061")
    assert build_config(worker_args(["--model", "m", "--kv-transfer-address", "w3.internal:7000"])
                        ).kv_transfer_address == "w3.internal:7000"
