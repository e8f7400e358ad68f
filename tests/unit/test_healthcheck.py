"""`python -m pagoda.runtime.healthcheck`: exit 0 only for SERVING (gRPC) or 200 (HTTP)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagoda.runtime.healthcheck import main


@pytest.fixture
def health_server() -> Iterator[tuple[health.HealthServicer, str]]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_grpc_exit_status_follows_serving_status(health_server) -> None:
    servicer, target = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main([target, "--timeout", "5"]) == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main([target, "--timeout", "5"]) == 0
    assert main([target, "--service", "pagoda.v1.Engine", "--timeout", "5"]) == 1  # unknown name


def test_unreachable_target_fails_within_timeout() -> None:
    assert main(["127.0.0.1:0", "--timeout", "0.5"]) == 1  # nothing listens on port 0


class _Ready(http.server.BaseHTTPRequestHandler):
    ready = False

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200 if self.path == "/ready" and _Ready.ready else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_http_exit_status_follows_ready() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Ready)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/ready"
    try:
        _Ready.ready = False
        assert main([url, "--timeout", "5"]) == 1
        _Ready.ready = True
        assert main([url, "--timeout", "5"]) == 0
    finally:
        server.shutdown()
        server.server_close()
