"""Runtime infrastructure every process uses: structured logging, OpenTelemetry tracing, TLS
credentials, gRPC health and container health probes. (Prometheus metrics are the gateway's alone:
gateway/metrics.py.)

It imports no service and nothing of the user-facing `pagoda` layer (tests/unit/test_boundaries.py).
"""
