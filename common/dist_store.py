"""Rendezvous pieces shared by every torch.distributed group splitserve makes at run time (KV pair
groups between workers, the tensor-parallel groups inside one): a TCPStore and gloo devices that
listen on one host only.

torch's TCPStore, left to itself, listens on every interface whatever host it is given; here it
takes a socket already bound to the host (master_listen_fd)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
Device = dist.ProcessGroupGloo.Device


def listen(host: str) -> socket.socket:
    """A listening socket on host alone."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno,
            f"cannot listen for torch.distributed rendezvous on {host!r} ({e.strerror}): the worker's "
            "advertised host must be an address of this machine",
        ) from e
    return sock


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """A TCPStore server on host (a free port: store.port)."""
    sock = listen(host)
    try:
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it goes (torch 2.13, libuv)
    return store


def gloo_device(host: str) -> Device:
    """Where gloo's pair sockets listen: host, or gloo's default (this machine's address) for a wildcard."""
    # Not lazy: the pairs connect while the group is built, so a handshake sees every address read.
    if host in WILDCARD_HOSTS:
        return dist.ProcessGroupGloo.create_default_device(lazy_init=False)
    return dist.ProcessGroupGloo.create_device(hostname=host, lazy_init=False)
