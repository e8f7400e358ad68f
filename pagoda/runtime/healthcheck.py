"""`python -m pagoda.runtime.healthcheck TARGET [--service NAME] [--timeout S]`: a container probe.

TARGET `HOST:PORT`: exit 0 iff grpc.health.v1 Check answers SERVING within the timeout (what
grpc_health_probe does). TARGET `http://...` (the gateway's /ready): exit 0 iff GET answers 200.
Otherwise exit 1 with the reason on stderr. The compose healthchecks of all three services use it
(the slim image has no curl).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check_serving(target: str, service: str = "", timeout_s: float = 3.0) -> tuple[bool, str]:
    """(serving, what was seen). Never raises for an unreachable or unhealthy server."""
    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return False, f"{err.code().name}: {err.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def check_http_ok(url: str, timeout_s: float = 3.0) -> tuple[bool, str]:
    """(answered 200, what was seen). Never raises for an unreachable or unready server."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            return reply.status == 200, f"HTTP {reply.status}"
    except urllib.error.HTTPError as err:
        return False, f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return False, str(err)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagoda.runtime.healthcheck", description=__doc__)
    parser.add_argument("target", help="HOST:PORT of a gRPC server, or an http:// URL")
    parser.add_argument("--service", default="", help="service name to check ('' = the server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    if args.target.startswith(("http://", "https://")):
        serving, seen = check_http_ok(args.target, args.timeout)
    else:
        serving, seen = check_serving(args.target, args.service, args.timeout)
    if not serving:
        print(f"{args.target}: {seen}", file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
