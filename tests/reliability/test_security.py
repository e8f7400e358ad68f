"""Security with real processes: the API key on HTTP and public gRPC, loopback-only default binds,
TLS on every gRPC hop (a self-signed certificate made here with `cryptography`), and per-tenant
prefix-cache isolation by cache_salt.
"""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagoda.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.e2e.conftest import ServiceProcess, free_port
from tests.e2e.gateway_conftest import start_gateway
from tests.reliability.conftest import FAKE_VOCAB_SIZE, TOKENIZER_DIR, completion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
KEY = "s3cret-key"
# 127.0.0.1 as /proc/net/tcp writes it, and as ::ffff:127.0.0.1 in tcp6 (gRPC's dual-stack socket)
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F"}
LISTEN = "0A"


@pytest.fixture(scope="module")
def keyed_gateway(fake_stack, tmp_path_factory):
    """A second gateway with an API key on the shared stack's scheduler: (process, http_url)."""
    gateway, http_url = start_gateway(fake_stack.scheduler.target, tmp_path_factory.mktemp("keyed"),
                                      "--tokenizer", str(TOKENIZER_DIR), "--api-key", KEY)
    yield gateway, http_url
    gateway.stop()


def _public_generate(target: str, metadata=(), credentials=None) -> list:
    channel = (grpc.secure_channel(target, credentials) if credentials
               else grpc.insecure_channel(target))
    with channel:
        request = gateway_pb2.GenerationRequest(prompt="The river",
                                                sampling=common_pb2.SamplingParams(max_tokens=3))
        return list(gateway_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata, timeout=10))


def test_api_key_guards_http_and_public_grpc(keyed_gateway):
    gateway, http_url = keyed_gateway
    assert completion(http_url).status_code == 401
    assert completion(http_url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert completion(http_url, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{http_url}/v1/models", timeout=5).status_code == 401
    for open_path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{http_url}{open_path}", timeout=5).status_code == 200
    with pytest.raises(grpc.RpcError) as refused:
        _public_generate(gateway.target)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _public_generate(gateway.target, metadata=(("authorization", f"Bearer {KEY}"),))


def _listen_addresses(port: int) -> set[str]:
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.rsplit(":", 1)
                if state == LISTEN and int(port_hex, 16) == port:
                    addresses.add(address)
    return addresses


def test_every_service_binds_loopback_by_default(fake_stack):
    stack = fake_stack
    http_port = int(stack.http_url.rsplit(":", 1)[1])
    for port in (stack.worker.port, stack.scheduler.port, stack.gateway.port, http_port):
        addresses = _listen_addresses(port)
        assert addresses and addresses <= LOOPBACK_HEX, (port, addresses)


def test_cache_salt_keeps_one_tenants_prefix_cache_from_another(fake_stack):
    prompt = list(range(100, 164))  # 64 tokens: 4 full blocks of 16; salts no other test uses

    def cached(salt: str) -> int:
        response = completion(fake_stack.http_url, prompt=prompt, max_tokens=2, cache_salt=salt)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, other tenant: nothing shared
    assert cached("tenant-a") >= 48  # same tenant again: the full blocks are hits


def _self_signed(directory) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pagoda-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def _tls_serving(target: str, credentials) -> bool:
    with grpc.secure_channel(target, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_on_every_grpc_hop(tmp_path):
    cert, key = _self_signed(tmp_path)
    credentials = grpc.ssl_channel_credentials(root_certificates=open(cert, "rb").read())
    tls = ["--tls-cert", cert, "--tls-key", key]
    worker_port, scheduler_port, http_port, grpc_port = (free_port() for _ in range(4))
    processes = []
    try:
        worker = ServiceProcess("worker", "worker_svc", ["--fake", "--port", str(worker_port), "--vocab-size",
                                                         str(FAKE_VOCAB_SIZE), *tls],
                                worker_port, tmp_path)
        processes.append(worker)
        scheduler = ServiceProcess("scheduler", "scheduler_svc", [
            "--workers", worker.target, "--port", str(scheduler_port), "--tls-ca", cert, *tls],
            scheduler_port, tmp_path)
        processes.append(scheduler)
        scheduler.wait_until(lambda: _tls_serving(scheduler.target, credentials), "SERVING over TLS")
        gateway = ServiceProcess("gateway", "gateway", [
            "--scheduler", scheduler.target, "--port", str(http_port), "--grpc-port", str(grpc_port),
            "--tokenizer", str(TOKENIZER_DIR), "--tls-ca", cert, *tls], grpc_port, tmp_path)
        processes.append(gateway)
        gateway.wait_until(lambda: _tls_serving(gateway.target, credentials), "SERVING over TLS")
        # HTTP -> gateway -TLS-> scheduler -TLS-> worker, and the public gRPC port over TLS.
        assert completion(f"http://127.0.0.1:{http_port}").status_code == 200
        assert _public_generate(gateway.target, credentials=credentials)
        with pytest.raises(grpc.RpcError):  # plaintext is refused on a TLS port
            _public_generate(gateway.target)
    finally:
        for process in reversed(processes):
            process.stop()
