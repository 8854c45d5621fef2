"""Emulated hosts on one machine: a network namespace per host, joined by a bridge, each with its own
address; a link can be rate-limited (tc tbf) or cut (its veth down) and healed. Processes run inside a
host with `ip netns exec`. Everything made here (namespaces, bridge, veths, processes) is removed on
close, and close runs on every exit path of the `hosts` context manager.

Needs root (CAP_NET_ADMIN) and iproute2; `available()` says why not where it cannot work. tc on these
machines has tbf and htb but not netem: links get rate limits, never added delay.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

from splitserve.services.launcher.launcher import _spawn

_SUBNET = "10.77"  # 10.77.<net>.0/24, one /24 per Hosts (net: from the pid, so runs side by side differ)


def available() -> str | None:
    """None where namespaces can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, a bridge, veths)"
    if shutil.which("ip") is None:
        return "emulated hosts need iproute2 (`ip`)"
    probe = f"ssprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", netns] if netns else []) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Host:
    name: str
    netns: str
    address: str  # its own address on the bridge
    veth: str  # the root namespace's end of its link (what cut, heal and limit act on)


@dataclass
class Hosts:
    """Hosts named in `names`, on one bridge; the root namespace gets the bridge's own address, so the
    test process reaches every host."""

    names: list[str]
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen] = field(default_factory=list)
    bridge: str = ""
    gateway_address: str = ""  # the root namespace's address on the bridge

    def __post_init__(self) -> None:
        tag = os.getpid() % 10000
        net = os.getpid() % 250 + 1
        self.bridge, self.gateway_address = f"ssbr{tag}", f"{_SUBNET}.{net}.254"
        try:
            self._make(net, tag)
        except BaseException:
            self.close()  # what was made so far
            raise

    def _make(self, net: int, tag: int) -> None:
        _ip("ip", "link", "add", self.bridge, "type", "bridge")
        _ip("ip", "addr", "add", f"{self.gateway_address}/24", "dev", self.bridge)
        _ip("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            host = Host(name, f"ss{tag}-{name}", f"{_SUBNET}.{net}.{i + 1}", f"ssv{tag}h{i}")
            self.hosts[name] = host
            _ip("ip", "netns", "add", host.netns)
            _ip("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            _ip("ip", "link", "set", host.veth, "master", self.bridge, "up")
            _ip("ip", "link", "set", "lo", "up", netns=host.netns)
            _ip("ip", "addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
            _ip("ip", "link", "set", "eth0", "up", netns=host.netns)

    def spawn(self, host: str, name: str, argv: list[str], on_line=None) -> subprocess.Popen:
        """`splitserve ARGV` (the launcher's CLI) on host, as the launcher starts its children (it dies
        with this process); its output echoed with [name]."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = _spawn(name, argv, env, on_line=on_line, prefix=["ip", "netns", "exec", self.hosts[host].netns])
        self.procs.append(proc)
        return proc

    def cut(self, host: str) -> None:
        """The host's link goes down: nothing in or out (its processes live on)."""
        _ip("ip", "link", "set", self.hosts[host].veth, "down")

    def heal(self, host: str) -> None:
        _ip("ip", "link", "set", self.hosts[host].veth, "up")

    def limit(self, host: str, rate: str) -> None:
        """Cap what reaches the host (e.g. "100mbit"; tbf on the root end of its link)."""
        veth = self.hosts[host].veth
        _ip("tc", "qdisc", "replace", "dev", veth, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms")

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()  # ip netns exec became the process itself
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for host in self.hosts.values():
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@contextlib.contextmanager
def hosts(names: list[str]) -> Iterator[Hosts]:
    made = Hosts(names)  # removes what it made if it fails half way
    try:
        yield made
    finally:
        made.close()
