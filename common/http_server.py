"""What every splitserve HTTP server (the gateway's OpenAI API, each process's /metrics) enforces on its
clients before the app sees a request: a bound on the request head and timers on what the server waits for.

uvicorn's httptools protocol has neither (llhttp buffers a header of any size; its keep-alive timer covers
only the time between requests), so LimitedHttpToolsProtocol adds them around it. A connection's waits:

    head  -> body  -> nothing  -> head ...
    (from the connection's start, or the first byte of the next request, to the end of the headers:
    head_timeout_s in all; then each pause in the body: idle_timeout_s; then the app works and answers,
    the client may stay silent, and uvicorn's keep-alive timer takes over once the answer is sent)
"""

from __future__ import annotations

import asyncio
import enum
import functools
import socket
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

_HEAD_END = b"\r\n\r\n"
_TOO_LARGE = b"request line and headers too large"


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_head_bytes: int = 64 * 1024  # request line + headers; over it: 431 and the connection closed
    head_timeout_s: float = 10.0  # a head not finished this long after it began: connection closed
    idle_timeout_s: float = 30.0  # a request body that sends nothing this long: connection closed

    def __post_init__(self) -> None:
        if self.max_head_bytes < 1024:
            raise ValueError(f"max_head_bytes must be at least 1024, got {self.max_head_bytes}")
        if self.head_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("head_timeout_s and idle_timeout_s must be positive")


def limited_config(app: Any, limits: HttpLimits, **options: Any) -> uvicorn.Config:
    """uvicorn's Config for one of our servers: the limited protocol, no websockets, no lifespan, the
    process's own logging and no access log (a line per request is the metrics' job)."""
    protocol = functools.partial(LimitedHttpToolsProtocol, limits=limits)
    return uvicorn.Config(
        app,
        http=protocol,  # type: ignore[arg-type]  # uvicorn calls it as it calls a protocol class
        ws="none",
        lifespan="off",
        log_config=None,
        access_log=False,
        **options,
    )


def bind_tcp(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn. Made with IPPROTO_TCP: asyncio turns Nagle off
    (TCP_NODELAY) on the connections it accepts only when the listening socket says it is TCP, and with
    Nagle on, each write after a response's first (its body, each SSE event) waits for the client's
    delayed ACK, about 40 ms."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


class _HeadCounter:
    """A request head's bytes as they arrive, up to the blank line that ends it."""

    def __init__(self) -> None:
        self.num_bytes = 0
        self._tail = b""  # the last bytes of the head so far: the end marker may be split across reads

    def add(self, data: bytes) -> None:
        joined = self._tail + data[: len(_HEAD_END) - 1]
        end = joined.find(_HEAD_END)
        if end >= 0:
            self.num_bytes += end + len(_HEAD_END) - len(self._tail)
            return
        end = data.find(_HEAD_END)
        self.num_bytes += len(data) if end < 0 else end + len(_HEAD_END)
        self._tail = (self._tail + data[-(len(_HEAD_END) - 1) :])[-(len(_HEAD_END) - 1) :]


class _Wait(enum.Enum):
    NOTHING = enum.auto()  # the app works or answers: the client may be silent
    HEAD = enum.auto()  # for the rest of a request head
    BODY = enum.auto()  # for more of a request body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded request head and a timer on each wait for the client.

    A head is counted before the parser sees it, so the parser never holds more than max_head_bytes of
    it. Bytes of a pipelined request that arrive in the same read as the end of the request before it
    are not counted (the parser gives no offsets): a head can overshoot the limit by one read (256 KiB)."""

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._head: _HeadCounter | None = _HeadCounter()  # None while the request's head is complete
        self._wait = _Wait.NOTHING
        self._since = 0.0  # when the current wait began (BODY: the last read)
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_wait(_Wait.HEAD)  # a client that connects and says nothing is a stalled head

    def connection_lost(self, exc: Exception | None) -> None:
        self._start_wait(_Wait.NOTHING)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # refused or timed out; TLS may still hand over what it had decrypted
        if self._head is not None:
            self._head.add(data)
            if self._head.num_bytes > self.limits.max_head_bytes:
                self._refuse_head()
                return
        if self._wait is _Wait.BODY:
            self._since = self.loop.time()
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._wait is _Wait.NOTHING:  # the first byte of the next request on this connection
            self._start_wait(_Wait.HEAD)

    def on_headers_complete(self) -> None:
        self._head = None
        self._start_wait(_Wait.BODY)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head = _HeadCounter()
        self._start_wait(_Wait.NOTHING)
        super().on_message_complete()

    def _start_wait(self, wait: _Wait) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._wait, self._since = wait, self.loop.time()
        if wait is not _Wait.NOTHING:
            self._timer = self.loop.call_later(self._timeout_s(), self._check_wait)

    def _timeout_s(self) -> float:
        return self.limits.head_timeout_s if self._wait is _Wait.HEAD else self.limits.idle_timeout_s

    def _check_wait(self) -> None:
        now = self.loop.time()
        if self.flow.read_paused:  # uvicorn stopped reading (a pipelined request, a full body buffer):
            self._since = now  # the client is not the one keeping us waiting
        due = self._since + self._timeout_s()
        if due > now:  # a body that moved since the timer was set, or paused reading
            self._timer = self.loop.call_later(due - now, self._check_wait)
            return
        self._timer = None
        self.transport.close()

    def _refuse_head(self) -> None:
        head = [STATUS_LINE[431]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head.append(b"content-type: text/plain; charset=utf-8\r\n")
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(_TOO_LARGE))
        self.transport.write(b"".join(head) + _TOO_LARGE)
        self.transport.close()
