"""Hostile bodies on the gateway's OpenAI HTTP API (the fuzz suite's HTTP cases), on a real gateway
and unified worker: 2,000,000 token ids x n=128, 1,000,000 stop strings x n=64, a 4 MB /detokenize,
lone UTF-16 surrogates. Each is answered (an OpenAI-shaped 4xx, or the decoded text), the gateway
keeps answering /health while it works on one, and afterwards still serves a plain request.

Each case prints the /health latencies seen while it was in flight and the gateway's memory (the
numbers docs/reliability.md records under "Hostile HTTP bodies"); none is asserted on.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cluster_helpers import engine_argv, write_chat_model

from splitserve.services.launcher.launcher import start_cluster, stop_cluster

ORIGIN = "https://app.example"
WAIT_S = 120.0  # an upper bound that only a broken run reaches
CHUNK_BYTES = 64 * 1024


def _compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# (path, body, statuses it may get): built lazily, some are 4 MB.
CASES = {
    "2M token ids x n=128": ("/v1/completions", lambda: _compact({"prompt": [1] * 2_000_000, "n": 128}), {400}),
    "1M stop strings x n=64": (
        "/v1/completions",
        lambda: _compact({"prompt": "hi", "stop": ["s"] * 1_000_000, "n": 64}),
        {400},
    ),
    "4 MB /detokenize": ("/detokenize", lambda: _compact({"tokens": [65] * 1_300_000}), {200}),
    "surrogate in a prompt": ("/v1/completions", lambda: json.dumps({"prompt": "a\ud800"}).encode(), {400}),
    "surrogate in a chat message": (
        "/v1/chat/completions",
        lambda: json.dumps({"messages": [{"role": "user", "content": "\udfff"}]}).encode(),
        {400},
    ),
    "surrogate in /tokenize": ("/tokenize", lambda: json.dumps({"prompt": "\ud800"}).encode(), {400}),
}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, tmp_path_factory):
    model = write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("hostile") / "tiny-llama-chat")
    children = start_cluster(1, engine_argv(model), gateway_argv=["--http-cors-origin", ORIGIN])
    try:
        yield children
    finally:
        stop_cluster(children)


def _memory_mib(pid: int) -> dict[str, float]:
    """The gateway's resident memory now (VmRSS) and at its peak so far (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {name: int(fields[name].split()[0]) / 1024 for name in ("VmRSS", "VmHWM")}


class Probe:
    """GET /health while the hostile request is in flight: once before its body's last byte goes out
    (the body waits for that answer: the assertion needs no timing), then in a loop from its last byte
    until its answer arrives (the latencies recorded: what a client of the gateway waits meanwhile)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.held, self.health_answered = threading.Event(), threading.Event()
        self.uploaded, self.answered = threading.Event(), threading.Event()
        self.latencies_s: list[float] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def body(self, content: bytes) -> Iterator[bytes]:
        for start in range(0, len(content) - 1, CHUNK_BYTES):
            yield content[start : min(start + CHUNK_BYTES, len(content) - 1)]
        self.held.set()
        assert self.health_answered.wait(WAIT_S), "/health got no answer while the hostile body was arriving"
        yield content[-1:]
        self.uploaded.set()  # asked for the next piece: the last byte went out

    def _run(self) -> None:
        with httpx.Client(timeout=WAIT_S) as client:
            self.held.wait(WAIT_S)
            assert client.get(f"{self.base}/health").status_code == 200
            self.health_answered.set()
            self.uploaded.wait(WAIT_S)
            while not self.answered.is_set():
                started = time.monotonic()
                assert client.get(f"{self.base}/health").status_code == 200
                self.latencies_s.append(time.monotonic() - started)


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_bodies_are_answered_while_health_keeps_answering(cluster, case):
    path, make_body, statuses = CASES[case]
    base = f"http://{cluster[0].http}"
    content = make_body()
    before = _memory_mib(cluster[0].proc.pid)
    probe = Probe(base)
    probe.thread.start()
    started = time.monotonic()
    with httpx.Client(timeout=WAIT_S) as client:
        headers = {"content-type": "application/json"}
        response = client.post(f"{base}{path}", content=probe.body(content), headers=headers)
    elapsed = time.monotonic() - started
    probe.answered.set()
    probe.thread.join(WAIT_S)
    after = _memory_mib(cluster[0].proc.pid)
    assert response.status_code in statuses, response.text[:300]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert probe.health_answered.is_set()  # while the hostile request was in flight (its body waited for it)
    worst = max(probe.latencies_s, default=0.0) * 1e3
    print(
        f"\n{case}: {len(content) / 1e6:.1f} MB body answered {response.status_code} in {elapsed:.2f} s; "
        f"/health answered {len(probe.latencies_s)} times after its last byte, slowest {worst:.1f} ms; gateway RSS "
        f"{before['VmRSS']:.0f} -> {after['VmRSS']:.0f} MiB (peak {after['VmHWM']:.0f} MiB)"
    )
    plain = httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=WAIT_S)
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2


def test_cors_origins_from_the_command_line(cluster):
    base = f"http://{cluster[0].http}"
    asks = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    preflight = httpx.options(f"{base}/v1/chat/completions", headers={"origin": ORIGIN, **asks})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(f"{base}/v1/models", headers={"origin": "https://elsewhere.example"})
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
