"""A real, throwaway redis-server for tests (no fakes): 127.0.0.1, a free port, no persistence."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitserve.common.serving import free_port


class RedisServer:
    """stop() then start() reuses the port, so clients pointed at url see a Redis restart."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(timeout_s)
        return self

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGCONT)  # in case a test left it paused
        self._process.terminate()
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process = None

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung Redis)."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        """A plain synchronous client, e.g. for FLUSHDB or to inspect keys."""
        return redis.Redis.from_url(self.url, decode_responses=True, socket_timeout=2)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with redis.Redis(
            port=self.port, socket_connect_timeout=0.2, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)
        ) as probe:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited with {self._process.returncode}")
                try:
                    if probe.ping():
                        return
                except redis.RedisError:  # not listening yet, or still loading
                    time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s} s")
