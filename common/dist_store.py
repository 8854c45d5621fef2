"""Rendezvous pieces shared by every torch.distributed group splitserve makes at run time (KV pair
groups between workers, the tensor-parallel groups inside one): a TCPStore and gloo devices that
listen on one host only.

torch's TCPStore, left to itself, listens on every interface whatever host it is given; here it
takes a socket already bound to the host (master_listen_fd).

The store has no authentication: anyone who reaches its port can read every key, write any value
of any size (held in the owner's memory until deleted) and delete keys. Nothing here can bound or
refuse a write: that needs the KV plane on a network others cannot reach (docs/security.md). What
this side does: publish nothing that leaks the process's memory (scrub_address_record) and delete
a channel's keys as soon as the pair no longer needs them (the KV transfer does)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist

WILDCARD_HOSTS = ("", "0.0.0.0", "::")
Device = dist.ProcessGroupGloo.Device
SOCKADDR_STORAGE_BYTES = 128
GLOO_ADDRESS_BYTES = SOCKADDR_STORAGE_BYTES + 8  # a sockaddr_storage, then a sequence number
# what each family fills of sockaddr_storage
_SOCKADDR_BYTES: dict[int, int] = {socket.AF_INET.value: 16, socket.AF_INET6.value: 28}


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


def host_store(host: str, timeout_s: float, sock: socket.socket | None = None) -> dist.TCPStore:
    """A TCPStore server on host (a free port: store.port), or on sock, a socket already listening there."""
    sock = listen(host) if sock is None else sock
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


def scrub_address_record(value: bytes) -> bytes:
    """gloo's record of where a rank listens, without the bytes it copies from the process's memory.

    gloo (tcp transport, as torch 2.13 builds it) publishes: a u64 hostname length, the hostname, a
    u64 address length, the address (a whole sockaddr_storage, then a u64 sequence number), then the
    pair ids. An IPv4 or IPv6 address fills only the first 16 or 28 bytes of the sockaddr_storage; gloo
    copies the rest as it found it, uninitialised: stack and libc addresses and canary-like words of
    the engine, readable by anyone who reads the store. The peer reads only its family's bytes, so
    zeroing the rest changes nothing for it. Any other value is returned unchanged."""
    start = _sockaddr_at(value)
    if start is None:
        return value
    used = _SOCKADDR_BYTES.get(int.from_bytes(value[start : start + 2], "little"))  # sa_family, host order
    if used is None:
        return value
    return value[: start + used] + bytes(SOCKADDR_STORAGE_BYTES - used) + value[start + SOCKADDR_STORAGE_BYTES :]


def _sockaddr_at(value: bytes) -> int | None:
    """Where a gloo address record's sockaddr_storage starts, or None when value is not one."""
    if len(value) < 8:
        return None
    length_at = 8 + int.from_bytes(value[:8], "little")  # after the hostname
    start = length_at + 8
    if start > len(value) or int.from_bytes(value[length_at:start], "little") != GLOO_ADDRESS_BYTES:
        return None
    return start if start + GLOO_ADDRESS_BYTES <= len(value) else None
