"""How `splitserve up` secures the processes it starts, and how it and its users then reach them.

Always: a throwaway cluster CA with certificates and a join secret (services/launcher/certs.py; kept in the
secrets folder, 0700, keys and secrets 0600) for the internal plane: every internal call carries the
secret, over mTLS that verifies the server's certificate first, so a local user who takes a port a
member dials (a dead worker's) never sees the secret. The public API stays plaintext and open.
--secure: TLS on the public API as well (the same CA) and an API key on every Generation call.
A secrets folder another user could read or replace is refused (InsecureSecrets), never reused.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.security import ClusterSecurity

# The files of a secrets folder (a `splitserve certs` bundle), in SecureBundle's field order.
FILE_NAMES = (
    "ca.pem", "ca-key.pem", "gateway.pem", "gateway-key.pem", "cluster.pem", "cluster-key.pem",
    "client.pem", "client-key.pem", "api-keys", "join-secret",
)  # fmt: skip
PRIVATE_NAMES = frozenset(n for n in FILE_NAMES if n.endswith("-key.pem")) | {"api-keys", "join-secret"}


class InsecureSecrets(ValueError):
    """The secrets folder, or a file in it, could be read or replaced by another user."""


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


def check_private(folder: Path) -> None:
    """InsecureSecrets unless folder, and all in it, belong to this user and no one else can change
    them, and its secrets and keys (mode 0600 when made) are readable by no one else."""
    if not folder.exists():
        return
    _check_owned(folder)
    for path in folder.iterdir():
        if path.is_file():
            _check_owned(path)
            if _is_private(path.name) and stat.S_IMODE(path.stat().st_mode) & 0o077:
                raise InsecureSecrets(f"{path} is readable by other users: chmod 600 it, or remove the folder")


def _is_private(name: str) -> bool:
    return name in PRIVATE_NAMES or name.endswith("-key.pem")  # any key, not only the bundle's


def _check_owned(path: Path) -> None:
    info = path.lstat()  # a link could point anywhere: judged as itself
    if stat.S_ISLNK(info.st_mode):
        raise InsecureSecrets(f"{path} is a symbolic link; `up` keeps its secrets in plain files")
    if info.st_uid != os.geteuid():
        raise InsecureSecrets(f"{path} is owned by uid {info.st_uid}, not by this user ({os.geteuid()}): remove it")
    if stat.S_IMODE(info.st_mode) & 0o022:
        raise InsecureSecrets(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o}): remove it")


def prepare_access(folder: Path, secure: bool, host: str) -> UpAccess:
    """The cluster's CA, certificates and secrets in folder (made, or reused if private), and the flags
    of each process: mTLS and the join secret inside; TLS and an API key outside only when secure."""
    from splitserve.services.launcher.certs import make_bundle  # cryptography: only where processes are launched

    check_private(folder)
    hosts = ("localhost", "127.0.0.1", *([host] if host not in ("localhost", "127.0.0.1", "0.0.0.0") else []))
    bundle = make_bundle(folder, hosts)
    internal = bundle.worker_argv()  # cluster CA, certificate, key and the join secret
    if not secure:
        return UpAccess(internal, internal, bundle.cluster(), internal, _plain_hint)
    return UpAccess(bundle.gateway_argv(), internal, bundle.cluster(), internal, bundle.client_hint, bundle.http_hint)


def _plain_hint(address: str) -> str:
    return f'try: splitserve generate --url {address} --chat "Hello!"'
