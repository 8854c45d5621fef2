"""The HTTP limits on a real gateway process (no worker), as the security review probed it: unfinished
16 MiB headers on 4 connections, 50 slowloris connections on the OpenAI port, 50 idle connections on the
metrics port. The gateway's memory and thread count are read from /proc and printed; the defaults apply
(64 KiB heads, 10 s head timeout).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from splitserve.common.serving import free_port

WAIT_S = 60.0  # an upper bound that only a broken run reaches (the head timeout is 10 s)
NUM_BIG, BIG_BYTES = 4, 16 << 20
NUM_IDLE = 50


@pytest.fixture(scope="module")
def gateway(tiny_llama_dir):
    """(process, HTTP port, metrics port) of a gateway without workers."""
    grpc_port, metrics_port, http_port = (free_port() for _ in range(3))
    argv = ["gateway", "--model", str(tiny_llama_dir), "--port", str(grpc_port)]
    argv += ["--metrics-port", str(metrics_port), "--http-port", str(http_port)]
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.services.launcher.cli", *argv])
    try:
        _wait_up(f"http://127.0.0.1:{http_port}/health", proc)
        yield proc, http_port, metrics_port
    finally:
        proc.terminate()
        proc.wait(15)


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the gateway exited with code {proc.returncode}"
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError(f"the gateway did not answer {url} within {WAIT_S} s")


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def _num_threads(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/task").iterdir()))


def _send_unfinished_head(sock: socket.socket) -> None:
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * BIG_BYTES)
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused while sending: the point


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed it (blocks until it does; a socket.timeout: still open after WAIT_S)."""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_unfinished_16_mib_heads_do_not_grow_the_gateway(gateway):
    proc, http_port, _ = gateway
    rss_before = _rss_mib(proc.pid)
    socks = [socket.create_connection(("127.0.0.1", http_port), timeout=WAIT_S) for _ in range(NUM_BIG)]
    try:
        senders = [threading.Thread(target=_send_unfinished_head, args=(s,)) for s in socks]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        grown_mib = _rss_mib(proc.pid) - rss_before  # read while the connections are still open
    finally:
        for s in socks:
            s.close()
    print(f"\n{NUM_BIG} x {BIG_BYTES >> 20} MiB unfinished heads: RSS {rss_before:.0f} MiB, +{grown_mib:.1f} MiB")
    assert grown_mib < 32, f"the gateway grew by {grown_mib:.0f} MiB"
    assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=WAIT_S).status_code == 200


def test_slowloris_connections_are_closed(gateway):
    _, http_port, _ = gateway
    socks = [socket.create_connection(("127.0.0.1", http_port), timeout=WAIT_S) for _ in range(NUM_IDLE)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        num_closed = sum(_closed_by_server(s) for s in socks)
    finally:
        for s in socks:
            s.close()
    assert num_closed == NUM_IDLE


def test_idle_metrics_connections_add_no_threads(gateway):
    proc, _, metrics_port = gateway
    num_before = _num_threads(proc.pid)
    socks = [socket.create_connection(("127.0.0.1", metrics_port), timeout=WAIT_S) for _ in range(NUM_IDLE)]
    try:
        for s in socks:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        # Answered after every idle connection was accepted (the listener accepts in order).
        scrape = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=WAIT_S)
        num_added = _num_threads(proc.pid) - num_before
    finally:
        for s in socks:
            s.close()
    print(f"\n{NUM_IDLE} idle /metrics connections: gateway threads {num_before} -> {num_before + num_added}")
    assert scrape.status_code == 200 and "splitserve_gateway" in scrape.text
    assert num_added < 5, f"{NUM_IDLE} idle connections added {num_added} threads"
