"""Every service takes the same logging / TLS / tracing / drain flags, declared once."""

from __future__ import annotations

import pytest

from gateway.__main__ import parse_args as gateway_args
from scheduler_svc.__main__ import parse_args as scheduler_args
from worker_svc.__main__ import parse_args as worker_args

COMMON = ["--log-level", "debug", "--no-log-json", "--tls-cert", "c.pem", "--tls-key", "k.pem",
          "--otlp-traces-endpoint", "http://collector:4317"]


def test_the_scheduler_takes_every_service_flag():
    args = scheduler_args(["--workers", "127.0.0.1:1", *COMMON, "--tls-ca", "ca.pem", "--shutdown-timeout", "7"])
    assert (args.log_level, args.log_json, args.tls_cert, args.tls_key, args.tls_ca) == (
        "debug", False, "c.pem", "k.pem", "ca.pem")
    assert (args.otlp_traces_endpoint, args.shutdown_timeout) == ("http://collector:4317", 7.0)


def test_the_gateway_carries_them_into_its_config():
    config = gateway_args([*COMMON, "--tls-ca", "ca.pem", "--shutdown-timeout", "7"])
    assert (config.log_level, config.log_json, config.tls_cert, config.tls_key, config.tls_ca) == (
        "debug", False, "c.pem", "k.pem", "ca.pem")
    assert (config.otlp_traces_endpoint, config.shutdown_timeout_s) == ("http://collector:4317", 7.0)


def test_the_worker_calls_no_peer_and_does_not_drain():
    args = worker_args(["--fake", *COMMON])
    assert (args.log_level, args.tls_cert, args.otlp_traces_endpoint) == ("debug", "c.pem",
                                                                          "http://collector:4317")
    for flag in (["--tls-ca", "ca.pem"], ["--shutdown-timeout", "7"]):
        with pytest.raises(SystemExit):
            worker_args(["--fake", *flag])
