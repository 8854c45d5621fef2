"""HTTP header limits and timeouts, in process, on both HTTP servers: the gateway's OpenAI API (HttpApi on
the test's event loop, with a fake planner and proxy) and /metrics (serve_metrics: its own thread).

A request head (request line and headers) over the limit is refused with 431 or a closed connection, and
the server does not buffer it; a connection that has not finished its head within the head timeout, or
stalls in its body for the idle timeout, is closed by the server; idle /metrics connections hold no
thread each; plain requests, keep-alive, big bodies, SSE streams and scrapes still work.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import pytest
from cluster_helpers import write_chat_model
from prometheus_client import CollectorRegistry, Counter
from test_openai_app import MODEL, Planner, Workers

from splitserve.common.http_server import HttpLimits
from splitserve.common.serving import serve_metrics, start_metrics_server
from splitserve.common.tokenizer import load_tokenizer
from splitserve.gateway.generation import GenerationCore
from splitserve.gateway.http.server import HttpApi, HttpSettings
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.validation import RequestLimits, RequestValidator
from splitserve.protos.v1 import generation_pb2 as gen_pb

WAIT_S = 15.0  # an upper bound that only a broken run reaches (the timeouts below are 1 s)
LIMITS = HttpLimits(max_head_bytes=64 * 1024, head_timeout_s=1.0, idle_timeout_s=1.0)
BIG_HEADER = b"x-big: " + b"a" * (1 << 20) + b"\r\n"  # 1 MiB
NUM_IDLE = 50


class Proxy:
    """Streams two tokens per request, each once `release` is set (the test holds a stream open with it)."""

    def __init__(self) -> None:
        self.started, self.release = asyncio.Event(), asyncio.Event()
        self.release.set()

    async def stream(self, plan, request, deadline, arrival, first_token_at=None):
        self.started.set()
        for i in range(2):
            await self.release.wait()
            response = gen_pb.GenerateResponse(request_id=request.request_id, text="x", token_ids=[5])
            if i == 1:
                response.finish_reason = gen_pb.FINISH_REASON_LENGTH
            yield response


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir, tmp_path_factory):
    return load_tokenizer(write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("limits") / "tiny-chat"))


def _core(tokenizer) -> SimpleNamespace:
    validator = RequestValidator(RequestLimits(), tokenizer, MODEL, Workers())
    proxy = Proxy()
    return SimpleNamespace(core=GenerationCore(256, validator, Planner(), proxy, GatewayMetrics()), proxy=proxy)


@asynccontextmanager
async def gateway_http(tokenizer, limits: HttpLimits = LIMITS) -> AsyncIterator[SimpleNamespace]:
    gateway = _core(tokenizer)
    settings = HttpSettings(host="127.0.0.1", port=0, max_body_bytes=4 << 20, limits=limits)
    api = await HttpApi.start(settings, gateway.core, GatewayMetrics(), None)
    try:
        yield SimpleNamespace(port=api.port, proxy=gateway.proxy)
    finally:
        await api.stop(grace_s=1)


@asynccontextmanager
async def metrics_http(limits: HttpLimits = LIMITS) -> AsyncIterator[SimpleNamespace]:
    registry = CollectorRegistry()
    Counter("splitserve_test_scrapes", "a counter for the test", registry=registry).inc()
    server = serve_metrics(registry, "127.0.0.1", 0, limits)
    try:
        yield SimpleNamespace(port=server.port)
    finally:
        server.stop()


SERVERS = {"gateway": gateway_http, "metrics": lambda tokenizer, **kw: metrics_http(**kw)}


def _status(answer: bytes) -> int | None:
    """The status code of the first response in `answer` (None: no status line)."""
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 2 and parts[0].startswith(b"HTTP/") else None


def _recv_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a reset counts as closed)."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _send_and_read(port: int, payload: bytes) -> bytes:
    """A blocking client (on a thread: its payload is not copied into an asyncio buffer that tracemalloc
    would count as the server's)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while sending: what the server answered is read below
        return _recv_all(sock)


async def _closed_by_server(port: int, sent: bytes) -> bytes:
    """Sends `sent`, then nothing; returns what the server sent before it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(sent)
        await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(), WAIT_S)
        except ConnectionResetError:
            return b""
    finally:
        writer.close()


# --- (1) a request head over the limit: refused, not buffered -------------------------------------------


@pytest.mark.parametrize("kind", SERVERS)
def test_a_1_mib_header_is_refused_without_buffering_it(kind, tokenizer):
    payload = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + BIG_HEADER + b"\r\n"

    async def run() -> tuple[bytes, int]:
        async with SERVERS[kind](tokenizer) as server:
            tracemalloc.start()
            try:
                answer = await asyncio.to_thread(_send_and_read, server.port, payload)
                return answer, tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()

    answer, peak_bytes = asyncio.run(run())
    assert answer == b"" or _status(answer) == 431, answer[:200]
    # The server holds at most the limit and one read from the socket (256 KiB), never the whole header.
    assert peak_bytes < 768 * 1024, f"the server buffered {peak_bytes} bytes for a 1 MiB header"


@pytest.mark.parametrize("kind", SERVERS)
def test_heads_under_the_limit_and_big_bodies_are_served(kind, tokenizer):
    """A 32 KiB header is served; so is a body far over the head limit sent in the same write as its head."""
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-pad: " + b"a" * (32 << 10) + b"\r\n\r\n"
    body = json.dumps({"prompt": [1] * 200_000}).encode()  # ~600 KiB: refused by the API for its length
    post = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )

    async def run() -> tuple[bytes, bytes]:
        async with SERVERS[kind](tokenizer) as server:
            return await asyncio.to_thread(_send_and_read, server.port, head), await asyncio.to_thread(
                _send_and_read, server.port, post
            )

    got_head, got_post = asyncio.run(run())
    assert _status(got_head) == 200, got_head[:200]
    if kind == "gateway":  # the API read the body: its prompt is over the context
        assert _status(got_post) == 400 and b"context_length_exceeded" in got_post, got_post[:300]
    else:  # /metrics answers, whatever the method
        assert _status(got_post) not in (None, 431), got_post[:200]


# --- (2) slow clients are closed by the server -----------------------------------------------------------

STALLS = {
    "nothing sent": b"",
    "half a request line": b"GET /hea",
    "headers unfinished": b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: 1\r\n",
    "body stalled": b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
}


@pytest.mark.parametrize("kind", SERVERS)
def test_stalled_clients_are_closed_by_the_server(kind, tokenizer):
    """One client per kind of stall, all at once (one timeout's wait for all of them)."""

    async def run() -> list:
        async with SERVERS[kind](tokenizer) as server:
            stalled = (_closed_by_server(server.port, sent) for sent in STALLS.values())
            return await asyncio.gather(*stalled, return_exceptions=True)

    outcomes = dict(zip(STALLS, asyncio.run(run())))
    kept_open = {stall: repr(e) for stall, e in outcomes.items() if isinstance(e, BaseException)}
    assert not kept_open, f"the server kept these connections open: {kept_open}"


def test_a_keep_alive_connection_stalled_in_its_next_head_is_closed(tokenizer):
    """After one answered request, a second head that never finishes: the keep-alive timer is off once its
    first bytes arrive, so only the head timeout closes it."""

    async def run() -> bytes:
        async with gateway_http(tokenizer) as server:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            try:
                writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
                length = int(next(x for x in head.split(b"\r\n") if x.startswith(b"content-length")).split(b":")[1])
                await asyncio.wait_for(reader.readexactly(length), WAIT_S)
                writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n")
                return head + await asyncio.wait_for(reader.read(), WAIT_S)
            finally:
                writer.close()

    answer = asyncio.run(run())
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.count(b"HTTP/1.1") == 1, answer[:300]


# --- (3) idle /metrics connections hold no thread each ---------------------------------------------------


def test_idle_metrics_connections_hold_no_thread_each():
    registry = CollectorRegistry()
    num_threads_before = threading.active_count()
    port = start_metrics_server(registry, "127.0.0.1", 0)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(NUM_IDLE)]
    try:
        for sock in idle:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # a head the server waits on
        # Answered after every idle connection was accepted (the listener accepts in order).
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT_S).status_code == 200
        num_added = threading.active_count() - num_threads_before
    finally:
        for sock in idle:
            sock.close()
    assert num_added < 5, f"{NUM_IDLE} idle connections added {num_added} threads"


# --- (4) what clients do every day still works ------------------------------------------------------------


def test_a_scrape_answers_the_registry_on_a_reused_connection():
    async def run() -> list[httpx.Response]:
        async with metrics_http() as server:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as client:
                return [await client.get("/metrics"), await client.get("/metrics")]

    for response in asyncio.run(run()):
        assert response.status_code == 200 and "splitserve_test_scrapes_total 1.0" in response.text


def test_an_sse_stream_outlives_the_head_and_idle_timeouts(tokenizer):
    """A stream that sends nothing for longer than both timeouts (measured by a slow client the server
    closes meanwhile) still ends with [DONE]: the timeouts cover what the server waits on from the client."""

    async def run() -> tuple[str, bytes]:
        async with gateway_http(tokenizer) as server:
            server.proxy.release.clear()
            body = {"prompt": [1, 2, 3], "stream": True, "max_tokens": 2}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=WAIT_S) as client:
                sent = asyncio.create_task(client.post("/v1/completions", json=body))
                await asyncio.wait_for(server.proxy.started.wait(), WAIT_S)
                slow = await _closed_by_server(server.port, b"GET /health HTTP/1.1\r\n")  # >= 1 s later
                server.proxy.release.set()
                response = await asyncio.wait_for(sent, WAIT_S)
                return response.text, slow

    text, slow = asyncio.run(run())
    assert slow == b""
    events = [line for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3, text


def test_the_gateway_sends_without_waiting_for_acks(tokenizer):
    """TCP_NODELAY on every accepted connection: uvicorn writes a response's head and body (and each SSE
    event) separately, and with Nagle on, each write after the first waits for the client's delayed ACK
    (~40 ms on Linux: 22 keep-alive requests/s where 15,000 were possible)."""

    async def run() -> list[int]:
        gateway = _core(tokenizer)
        settings = HttpSettings(host="127.0.0.1", port=0, max_body_bytes=4 << 20, limits=LIMITS)
        api = await HttpApi.start(settings, gateway.core, GatewayMetrics(), None)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{api.port}", timeout=WAIT_S) as client:
                assert (await client.get("/health")).status_code == 200
                sockets = [c.transport.get_extra_info("socket") for c in api.server.server_state.connections]
                return [s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets]
        finally:
            await api.stop(grace_s=1)

    nodelay = asyncio.run(run())
    assert nodelay and all(nodelay), nodelay
