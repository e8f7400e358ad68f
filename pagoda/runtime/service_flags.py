"""The flags every Pagoda service takes, declared once: logging, TLS, tracing and drain time.

Each service's `__main__` adds its own flags and then these; what differs between services is only
which port TLS protects, whether it calls a peer over TLS, and whether it drains on SIGTERM.
"""

from __future__ import annotations

import argparse

from pagoda.runtime.logging import configure_logging


def add_service_flags(parser: argparse.ArgumentParser, *, serves: str, verifies: str | None = None,
                      drains: bool = True) -> None:
    """`serves`: the port --tls-cert/--tls-key protect; `verifies`: the peer --tls-ca checks (no
    --tls-ca without one); `drains`: whether --shutdown-timeout applies (the worker stops at once)."""
    group = parser.add_argument_group("service")
    group.add_argument("--log-level", default="info", help="debug, info, warning or error")
    group.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None,
                       help="JSON log lines (default: JSON unless stdout is a terminal)")
    group.add_argument("--tls-cert", default=None, help=f"PEM cert of the {serves} port (with --tls-key)")
    group.add_argument("--tls-key", default=None, help=f"PEM key of the {serves} port")
    if verifies:
        group.add_argument("--tls-ca", default=None, help=f"PEM CA to verify the {verifies} (TLS channel)")
    group.add_argument("--otlp-traces-endpoint", default=None,
                       help="OTLP gRPC endpoint for traces (default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)")
    if drains:
        group.add_argument("--shutdown-timeout", type=float, default=30.0,
                           help="seconds in-flight requests may take to finish after SIGTERM")


def configure_service_logging(args: argparse.Namespace, service: str) -> None:
    configure_logging(json=args.log_json, level=args.log_level, service=service)
