"""How `splitserve up` secures the processes it starts, and how it and its users then reach them.

Default: a join secret (made once, kept in the secrets folder, mode 0600) that every internal call
carries, with everything bound to --host (127.0.0.1): nothing to set up, and nobody who is not
given the file can register a worker, publish KV events or call a worker.
--secure: a throwaway CA with certificates (launch/certs.py) and an API key as well: TLS on the
public API, mTLS between all processes, and a key on every Generation call.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.security import ClusterSecurity

JOIN_SECRET_FILE = "join-secret"


_CHAT_BODY = """'{"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}'"""


def plain_http_hint(address: str) -> str:
    """How to call the OpenAI HTTP API at address (HOST:PORT) of a plaintext gateway without keys."""
    return (
        f"OpenAI-compatible API: http://{address}/v1\n"
        f"  curl http://{address}/v1/chat/completions -H 'Content-Type: application/json' -d {_CHAT_BODY}"
    )


@dataclass(frozen=True, slots=True)
class UpAccess:
    gateway_argv: list[str]  # flags for the gateway
    worker_argv: list[str]  # flags for every worker
    cluster: ClusterSecurity  # how `up` itself reaches them (health checks)
    operator_argv: list[str]  # what `splitserve workers` / `scale` need
    client_hint: Callable[[str], str]  # gateway address -> printed lines: how to call it
    http_hint: Callable[[str], str] = plain_http_hint  # HTTP API address -> printed lines: how to call it


def ensure_join_secret(folder: Path) -> Path:
    """The folder's join secret file, made (0600, in a 0700 folder) if missing."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / JOIN_SECRET_FILE
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    return path


def prepare_access(folder: Path, secure: bool, host: str) -> UpAccess:
    if secure:
        return _secure(folder, host)
    secret = str(ensure_join_secret(folder))
    argv = ["--join-secret-file", secret]
    return UpAccess(argv, argv, ClusterSecurity.from_files(secret_file=secret), argv, _plain_hint)


def _secure(folder: Path, host: str) -> UpAccess:
    from splitserve.launch.certs import make_bundle  # cryptography: only for --secure

    hosts = ("localhost", "127.0.0.1", *([host] if host not in ("localhost", "127.0.0.1", "0.0.0.0") else []))
    bundle = make_bundle(folder, hosts)
    secret = str(bundle.join_secret)
    cluster = bundle.cluster()
    operator = ["--cluster-ca", str(bundle.ca_cert), "--join-secret-file", secret]
    return UpAccess(
        bundle.gateway_argv(), bundle.worker_argv(), cluster, operator, bundle.client_hint, bundle.http_hint
    )


def _plain_hint(address: str) -> str:
    return f'try: splitserve generate --url {address} --chat "Hello!"'
