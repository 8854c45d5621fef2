"""services/launcher/certs.py: the throwaway PKI. Real gRPC servers on 127.0.0.1 check that the certificates do
what the gateway and workers need: public TLS, mTLS inside the cluster by the name CLUSTER_TLS_NAME,
and mTLS for public clients."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.common.security import CLUSTER_TLS_NAME
from splitserve.services.launcher import cli
from splitserve.services.launcher.certs import FILE_NAMES, PRIVATE_NAMES, SecureBundle, make_bundle

SERVER_AUTH, CLIENT_AUTH = ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> SecureBundle:
    return make_bundle(tmp_path_factory.mktemp("pki") / "secrets")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> SecureBundle:
    return make_bundle(tmp_path_factory.mktemp("other-pki"))


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def san_names(cert: x509.Certificate) -> set[str]:
    return {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}


def usages(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_files_and_modes(bundle: SecureBundle) -> None:
    folder = bundle.ca_cert.parent
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILE_NAMES)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in FILE_NAMES:
        mode = stat.S_IMODE((folder / name).stat().st_mode)
        assert mode == (0o600 if name in PRIVATE_NAMES else 0o644), name
    assert {"ca-key.pem", "gateway-key.pem", "cluster-key.pem", "client-key.pem"} < PRIVATE_NAMES


def test_api_key_join_secret_and_flags(bundle: SecureBundle) -> None:
    assert bundle.api_key.startswith("sk-splitserve-") and len(bundle.api_key) > 40
    lines = bundle.api_keys.read_text().splitlines()
    assert lines[0].startswith("#") and lines[1:] == [bundle.api_key]
    secret = bundle.join_secret.read_text()
    assert secret.endswith("\n") and len(bytes.fromhex(secret.strip())) == 32
    worker = bundle.worker_argv()
    assert dict(zip(worker[::2], worker[1::2])) == {
        "--cluster-ca": str(bundle.ca_cert),
        "--cluster-cert": str(bundle.cluster_cert),
        "--cluster-key": str(bundle.cluster_key),
        "--join-secret-file": str(bundle.join_secret),
    }
    assert bundle.gateway_argv() == [
        *("--tls-cert", str(bundle.gateway_cert), "--tls-key", str(bundle.gateway_key)),
        *("--api-key-file", str(bundle.api_keys), *worker),
    ]
    hint = bundle.client_hint("localhost:50051")
    assert f"--url localhost:50051 --tls-ca {bundle.ca_cert}" in hint
    assert "localhost:50051 splitserve.v1.Generation/Generate" in hint and '{"text": "Hello"}' in hint


def test_certificates(bundle: SecureBundle) -> None:
    ca = load(bundle.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    ca.verify_directly_issued_by(ca)
    expected = {
        bundle.gateway_cert: ({"localhost", "127.0.0.1", CLUSTER_TLS_NAME}, {SERVER_AUTH, CLIENT_AUTH}),
        bundle.cluster_cert: ({CLUSTER_TLS_NAME, "localhost", "127.0.0.1"}, {SERVER_AUTH, CLIENT_AUTH}),
        bundle.client_cert: ({"splitserve-client"}, {CLIENT_AUTH}),
    }
    for path, (names, eku) in expected.items():
        cert = load(path)
        cert.verify_directly_issued_by(ca)
        assert (san_names(cert), usages(cert)) == (names, eku), path.name
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert 360 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 366


def test_hosts_become_dns_and_ip_names(tmp_path: Path) -> None:
    bundle = make_bundle(tmp_path, ["gateway", "10.0.0.7", "::1", "gateway"])
    sans = load(bundle.gateway_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["gateway", CLUSTER_TLS_NAME]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.7", "::1"]


def test_an_existing_bundle_is_reused(tmp_path: Path) -> None:
    first = make_bundle(tmp_path / "b", ["gateway", "localhost"])
    ca_pem = first.ca_cert.read_bytes()
    again = make_bundle(tmp_path / "b", ["localhost"])  # any subset of the names it holds
    assert again == first and again.ca_cert.read_bytes() == ca_pem
    with pytest.raises(ValueError, match=r"does not name 127\.0\.0\.1; make a new bundle with --overwrite"):
        make_bundle(tmp_path / "b", ["127.0.0.1"])
    renewed = make_bundle(tmp_path / "b", overwrite=True)
    assert renewed.api_key != first.api_key and renewed.ca_cert.read_bytes() != ca_pem
    renewed_ca_pem = renewed.ca_cert.read_bytes()
    renewed.join_secret.unlink()  # incomplete: made anew, never patched up with a mismatched file
    remade = make_bundle(tmp_path / "b")
    assert remade.join_secret.exists() and remade.ca_cert.read_bytes() != renewed_ca_pem


def test_certs_command_writes_a_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["certs", "--out", str(tmp_path / "s"), "--host", "gateway", "--host", "localhost"]) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "s") in out and "--join-secret-file" in out
    assert san_names(load(tmp_path / "s" / "gateway.pem")) == {"gateway", "localhost", CLUSTER_TLS_NAME}
    assert cli.main(["certs", "--out", str(tmp_path / "s"), "--host", "elsewhere"]) == 2
    assert "--overwrite" in capsys.readouterr().err


# ---- real gRPC servers on 127.0.0.1 -------------------------------------------------------------


def server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    roots = client_ca.read_bytes() if client_ca else None
    pair = [(key.read_bytes(), cert.read_bytes())]
    return grpc.ssl_server_credentials(pair, root_certificates=roots, require_client_auth=client_ca is not None)


def client_credentials(ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    pair = (key.read_bytes(), cert.read_bytes()) if cert and key else (None, None)
    return grpc.ssl_channel_credentials(ca.read_bytes(), private_key=pair[0], certificate_chain=pair[1])


async def health_check(
    server: grpc.ServerCredentials, client: grpc.ChannelCredentials | None, target_name: str | None = None
) -> bool:
    """Whether a Health.Check over these credentials succeeds (False: the handshake failed)."""
    srv = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    address = f"127.0.0.1:{srv.add_secure_port('127.0.0.1:0', server)}"
    await srv.start()
    options = [("grpc.ssl_target_name_override", target_name)] if target_name else []
    channel = grpc.aio.secure_channel(address, client, options) if client else grpc.aio.insecure_channel(address)
    try:
        async with channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
        return False
    finally:
        await srv.stop(None)


def test_public_tls(bundle: SecureBundle, other_ca: SecureBundle) -> None:
    server = server_credentials(bundle.gateway_cert, bundle.gateway_key)
    assert asyncio.run(health_check(server, client_credentials(bundle.ca_cert)))
    assert not asyncio.run(health_check(server, None))  # plaintext
    assert not asyncio.run(health_check(server, client_credentials(other_ca.ca_cert)))


def test_cluster_mtls_by_cluster_name(bundle: SecureBundle, other_ca: SecureBundle) -> None:
    server = server_credentials(bundle.cluster_cert, bundle.cluster_key, client_ca=bundle.ca_cert)
    member = client_credentials(bundle.ca_cert, bundle.cluster_cert, bundle.cluster_key)
    assert asyncio.run(health_check(server, member, target_name=CLUSTER_TLS_NAME))
    assert not asyncio.run(health_check(server, client_credentials(bundle.ca_cert), target_name=CLUSTER_TLS_NAME))
    stranger = client_credentials(bundle.ca_cert, other_ca.cluster_cert, other_ca.cluster_key)
    assert not asyncio.run(health_check(server, stranger, target_name=CLUSTER_TLS_NAME))
    # The gateway presents gateway.pem on its port; workers dialling it by CLUSTER_TLS_NAME accept it too.
    gateway = server_credentials(bundle.gateway_cert, bundle.gateway_key, client_ca=bundle.ca_cert)
    assert asyncio.run(health_check(gateway, member, target_name=CLUSTER_TLS_NAME))


def test_public_mtls_with_the_client_certificate(bundle: SecureBundle) -> None:
    server = server_credentials(bundle.gateway_cert, bundle.gateway_key, client_ca=bundle.ca_cert)
    client = client_credentials(bundle.ca_cert, bundle.client_cert, bundle.client_key)
    assert asyncio.run(health_check(server, client))
    assert not asyncio.run(health_check(server, client_credentials(bundle.ca_cert)))
