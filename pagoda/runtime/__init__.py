"""Runtime infrastructure every process uses: structured logging, OpenTelemetry tracing, TLS
credentials, gRPC health, container health probes and Prometheus metrics.

It imports no service and nothing of the user-facing `pagoda` layer (tests/unit/test_boundaries.py).
"""
