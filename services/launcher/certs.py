"""A throwaway PKI for `splitserve up --secure`, `splitserve certs` and the compose files.

One folder holds everything a secured deployment needs:
  ca.pem, ca-key.pem            a self-signed CA; every process and client trusts ca.pem
  gateway.pem, gateway-key.pem  the public API's certificate: the given hosts and CLUSTER_TLS_NAME
  cluster.pem, cluster-key.pem  the certificate every process presents inside the cluster (mTLS)
  client.pem, client-key.pem    a public client's certificate, for gateways that require one
  api-keys                      one API key (the gateway's --api-key-file)
  join-secret                   the secret workers show the gateway and each other

For trying things out, not production: the CA key lies unencrypted beside the certificates, nothing
can be revoked, and every certificate expires after VALID_FOR (make a new bundle with overwrite).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitserve.common.security import CLUSTER_TLS_NAME, ClusterSecurity, TlsIdentity
from splitserve.services.launcher.access import FILE_NAMES, PRIVATE_NAMES
from splitserve.services.launcher.cli import DEFAULT_HOSTS

VALID_FOR = timedelta(days=365)
CLOCK_SKEW = timedelta(hours=1)  # valid from an hour ago, for hosts whose clocks run a little behind
API_KEY_PREFIX = "sk-splitserve-"

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True, slots=True)
class SecureBundle:
    """The files of one bundle and the API key written to api_keys."""

    ca_cert: Path
    ca_key: Path
    gateway_cert: Path
    gateway_key: Path
    cluster_cert: Path
    cluster_key: Path
    client_cert: Path
    client_key: Path
    api_keys: Path
    join_secret: Path
    api_key: str

    @classmethod
    def at(cls, folder: Path, api_key: str) -> SecureBundle:
        ca, ca_key, gateway, gateway_key, cluster, cluster_key, client, client_key, keys, secret = (
            folder / name for name in FILE_NAMES
        )
        return cls(ca, ca_key, gateway, gateway_key, cluster, cluster_key, client, client_key, keys, secret, api_key)

    def gateway_argv(self) -> list[str]:
        """Flags of `splitserve gateway`: public TLS, API keys and the cluster's mTLS and secret."""
        public = ["--tls-cert", self.gateway_cert, "--tls-key", self.gateway_key, "--api-key-file", self.api_keys]
        return [str(arg) for arg in public] + self.worker_argv()

    def worker_argv(self) -> list[str]:
        """Flags of `splitserve worker` (and the gateway's cluster side): mTLS and the join secret."""
        cluster = ["--cluster-ca", self.ca_cert, "--cluster-cert", self.cluster_cert, "--cluster-key", self.cluster_key]
        return [str(arg) for arg in [*cluster, "--join-secret-file", self.join_secret]]

    def cluster(self, join_secret: bool = True) -> ClusterSecurity:
        """How a member of the cluster reaches the others: the cluster CA and certificate, and the join
        secret (without it: an outsider holding a cluster certificate, for tests)."""
        secret = str(self.join_secret) if join_secret else None
        return ClusterSecurity.from_files(str(self.ca_cert), str(self.cluster_cert), str(self.cluster_key), secret)

    def client_identity(self) -> TlsIdentity:
        """The client certificate, for a gateway that requires one (--tls-client-ca)."""
        return TlsIdentity.load(str(self.client_cert), str(self.client_key))

    def client_hint(self, address: str) -> str:
        """How a user calls the gateway at address (HOST:PORT) with this bundle's CA and API key."""
        ca, keys = shlex.quote(str(self.ca_cert)), shlex.quote(str(self.api_keys))
        return f"""The gateway at {address} takes TLS (verify it with {ca}) and an API key:
  export SPLITSERVE_API_KEY=$(grep -m1 -v '^#' {keys})
  splitserve generate --url {address} --tls-ca {ca} "Hello"
  grpcurl -cacert {ca} -H "authorization: Bearer $SPLITSERVE_API_KEY" -d '{{"text": "Hello"}}' \\
      {address} splitserve.v1.Generation/Generate"""

    def http_hint(self, address: str) -> str:
        """How a user calls the OpenAI HTTP API at address (HOST:PORT): HTTPS, the same CA and key."""
        ca = shlex.quote(str(self.ca_cert))
        return f"""OpenAI-compatible API: https://{address}/v1 (the same CA and API key):
  curl --cacert {ca} -H "Authorization: Bearer $SPLITSERVE_API_KEY" https://{address}/v1/models"""


def make_bundle(out_dir: Path, hosts: Sequence[str] = DEFAULT_HOSTS, overwrite: bool = False) -> SecureBundle:
    """Writes a bundle into out_dir, or returns the complete one already there (unless overwrite).

    hosts: the names clients and workers dial the gateway by (IP literals become IP SANs)."""
    folder = out_dir.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    existing = [folder / name for name in FILE_NAMES if (folder / name).exists()]
    if len(existing) == len(FILE_NAMES) and not overwrite:
        bundle = SecureBundle.at(folder, _read_api_key(folder / "api-keys"))
        _check_hosts(bundle.gateway_cert, hosts)
        return bundle
    for path in existing:  # a crash below then leaves an incomplete bundle, never a mismatched one
        path.unlink()
    api_key = API_KEY_PREFIX + secrets.token_urlsafe(32)
    for name, data in _bundle_files(list(hosts), api_key).items():
        _write(folder / name, data, 0o600 if name in PRIVATE_NAMES else 0o644)
    return SecureBundle.at(folder, api_key)


def _bundle_files(hosts: list[str], api_key: str) -> dict[str, bytes]:
    now = datetime.now(UTC)
    ca_key = _new_key()
    ca = _ca_cert(ca_key, now)
    server_and_client = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    gateway_names = list(dict.fromkeys([*hosts, CLUSTER_TLS_NAME]))
    files = {"ca.pem": ca.public_bytes(Encoding.PEM), "ca-key.pem": _key_pem(ca_key)}
    for stem, names, usages in (
        ("gateway", gateway_names, server_and_client),
        ("cluster", [CLUSTER_TLS_NAME, *DEFAULT_HOSTS], server_and_client),
        ("client", ["splitserve-client"], [ExtendedKeyUsageOID.CLIENT_AUTH]),
    ):
        key = _new_key()
        files[f"{stem}.pem"] = _leaf_cert(key, names, usages, ca, ca_key, now).public_bytes(Encoding.PEM)
        files[f"{stem}-key.pem"] = _key_pem(key)
    api_keys = f"# splitserve API keys, one a line; clients send one as 'authorization: Bearer KEY'\n{api_key}\n"
    files["api-keys"] = api_keys.encode()
    files["join-secret"] = f"{secrets.token_hex(32)}\n".encode()
    return files


def _new_key() -> Key:
    return ec.generate_private_key(ec.SECP256R1())


def _builder(common_name: str, issuer: x509.Name | None, key: Key, now: datetime) -> x509.CertificateBuilder:
    """A certificate for key named common_name; issuer None: self-signed."""
    organization = x509.NameAttribute(NameOID.ORGANIZATION_NAME, "splitserve")
    subject = x509.Name([organization, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )


def _key_usage(ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not ca, content_commitment=False, key_encipherment=False, data_encipherment=False,
        key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False,
    )  # fmt: skip


def _ca_cert(key: Key, now: datetime) -> x509.Certificate:
    builder = _builder("splitserve throwaway CA", None, key, now)
    builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    return builder.add_extension(_key_usage(ca=True), critical=True).sign(key, hashes.SHA256())


def _leaf_cert(
    key: Key, names: list[str], usages: list[x509.ObjectIdentifier], ca: x509.Certificate, ca_key: Key, now: datetime
) -> x509.Certificate:
    builder = (
        _builder(names[0], ca.subject, key, now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    return builder.sign(ca_key, hashes.SHA256())


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _key_pem(key: Key) -> bytes:
    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())


def _write(path: Path, data: bytes, mode: int) -> None:
    # Created with its final mode (no moment readable by others); chmod because umask may narrow it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    path.chmod(mode)


def _check_hosts(gateway_cert: Path, hosts: Sequence[str]) -> None:
    cert = x509.load_pem_x509_certificate(gateway_cert.read_bytes())
    names = {str(n.value) for n in cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value}
    if missing := [h for h in hosts if str(_general_name(h).value) not in names]:
        raise ValueError(
            f"{gateway_cert} does not name {', '.join(missing)}; make a new bundle with --overwrite "
            "(which replaces every key and secret in the folder) or use another folder"
        )


def _read_api_key(path: Path) -> str:
    keys = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not keys:
        raise ValueError(f"{path} holds no API key; add one or make a new bundle with --overwrite")
    return keys[0]


def run(args: argparse.Namespace) -> int:
    bundle = make_bundle(args.out, args.hosts or DEFAULT_HOSTS, args.overwrite)
    print(f"bundle in {bundle.ca_cert.parent} (keys and secrets mode 0600): {' '.join(FILE_NAMES)}")
    print(f"gateway flags: {shlex.join(bundle.gateway_argv())}")
    print(f"worker flags:  {shlex.join(bundle.worker_argv())}")
    return 0
