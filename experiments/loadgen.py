"""Sends a workload to a server and records what each request saw.

The client side is pluggable (GenerationClient): GrpcClient speaks splitserve's Generation API;
OpenAIClient streams from any OpenAI-compatible HTTP server (/v1/completions or /v1/chat/completions:
splitserve's gateway, vLLM, SGLang, ...), so one harness measures them side by side.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import httpx

from splitserve.common.security import PLAINTEXT_GATEWAY, GatewayCredentials
from splitserve.experiments.prompts import PromptKey, chat_prompts
from splitserve.experiments.stats import RequestRecord
from splitserve.experiments.workload import RequestSpec, WorkloadConfig, arrival_offsets, make_requests
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

API_KEY_ENVS = ("OPENAI_API_KEY", "SPLITSERVE_API_KEY")  # OpenAIClient's key when none is given, first set wins
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True, slots=True)
class Chunk:
    num_tokens: int
    queue_ms: float | None = None  # on the last chunk, when the server reports it (splitserve's gRPC API)
    prompt_tokens: int | None = None  # on the last chunk, when the server reports it (OpenAI usage)


class ClientError(Exception):
    """A request that failed; code names how: a gRPC status name, "HTTP 429", a transport error."""

    def __init__(self, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}" if detail else code)
        self.code = code


class GenerationClient(ABC):
    """One server, many concurrent requests. Each request's output is a stream of Chunks, timed by
    the caller as they arrive."""

    async def prepare(self, specs: Sequence[RequestSpec]) -> None:
        """Called once with every request of a run, before its clock starts: look up what requests
        need from the server (a model name, text prompts) here, not while they are timed."""

    @abstractmethod
    def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk]:
        """Stream one request's chunks (greedy, max_tokens, ignoring EOS where the server can); raise
        ClientError on failure."""

    async def close(self) -> None:
        pass


Connect = Callable[[WorkloadConfig], GenerationClient]  # a new client for one run, sized to its workload


class GrpcClient(GenerationClient):
    def __init__(
        self, address: str, timeout_s: float = 600.0, credentials: GatewayCredentials = PLAINTEXT_GATEWAY
    ) -> None:
        self._channel = credentials.channel(address, options=[("grpc.max_concurrent_streams", 10000)])
        self._stub = pb_grpc.GenerationStub(self._channel)
        self.timeout_s = timeout_s

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=spec.prompt_token_ids),
            sampling=pb.SamplingParameters(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=spec.max_tokens, ignore_eos=True),
        )
        try:
            async for chunk in self._stub.Generate(request, timeout=self.timeout_s):
                last = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                yield Chunk(len(chunk.token_ids), chunk.timings.queue_ms if last else None)
        except grpc.aio.AioRpcError as e:
            raise ClientError(e.code().name, e.details() or "") from None

    async def close(self) -> None:
        await self._channel.close()


@dataclass(frozen=True, slots=True)
class OpenAIConfig:
    """Where and how OpenAIClient sends. base_url is the server's root (a trailing /v1 is dropped)."""

    base_url: str
    endpoint: str = "completions"  # or "chat"
    model: str | None = None  # None: the first model GET /v1/models lists
    api_key: str | None = None  # None: the first of API_KEY_ENVS that is set; sent as a bearer token
    verify: bool | str | ssl.SSLContext = True  # TLS: verify with the system CAs, a CA file, a context, or not
    ignore_eos: bool = True  # send vLLM's ignore_eos (off for servers that reject unknown fields)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")

    def connect(self, cfg: WorkloadConfig) -> OpenAIClient:
        return OpenAIClient(self, pool_size(cfg))


def pool_size(cfg: WorkloadConfig) -> int | None:
    """Connections for a workload: its concurrency, or no limit for open-loop arrivals (Poisson, bursts),
    so no request ever waits in the client for a free connection (that wait would count as TTFT)."""
    return cfg.concurrency if cfg.arrival == "concurrency" else None


class OpenAIClient(GenerationClient):
    """Streaming POSTs to /v1/completions (the prompt as token ids: exact lengths) or
    /v1/chat/completions (the prompt as text of about its length: experiments/prompts.py), over
    HTTP/1.1 keep-alive connections (httpx), greedy, with stream_options.include_usage.

    Each server-sent event with text (or, for chat, delta content) counts one token at its arrival;
    the usage chunk's completion_tokens then adds the tokens no event showed (several in one event, or
    text a server held back), at the end, so output counts and TPOT are exact while ITLs see them as
    zero gaps, as gRPC chunks of several tokens do. Without usage, events are the count."""

    def __init__(self, config: OpenAIConfig, max_connections: int | None = None) -> None:
        self.config = config
        self.model = config.model
        self._chat = config.endpoint == "chat"
        self._path = "/v1/chat/completions" if self._chat else "/v1/completions"
        self._texts: dict[PromptKey, str] = {}
        api_key = config.api_key or next(filter(None, map(os.environ.get, API_KEY_ENVS)), None)
        keepalive = max_connections if max_connections is not None else 256
        self._http = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/").removesuffix("/v1"),
            headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
            timeout=config.timeout_s,
            verify=config.verify,
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=keepalive),
        )

    async def prepare(self, specs: Sequence[RequestSpec]) -> None:
        try:
            if self.model is None:
                self.model = await self._first_model()
            if self._chat:
                missing = [s for s in specs if tuple(s.prompt_token_ids) not in self._texts]
                self._texts.update(await chat_prompts(self._http, self.model, missing))
        except (httpx.TransportError, httpx.HTTPStatusError) as e:
            raise RuntimeError(f"preparing requests for {self._http.base_url} failed: {e}") from None

    async def _first_model(self) -> str:
        response = await self._http.get("/v1/models")
        if response.status_code != 200:
            raise RuntimeError(
                f"GET {self._http.base_url}/v1/models answered HTTP {response.status_code} "
                f"({response.text[:200]}); check the API key, or name the model (--model)"
            )
        return str(response.json()["data"][0]["id"])

    def _body(self, spec: RequestSpec) -> dict:
        body: dict = {"max_tokens": spec.max_tokens, "temperature": 0.0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        if self.model is not None:  # None until prepare() asked the server
            body["model"] = self.model
        if self.config.ignore_eos:
            body["ignore_eos"] = True
        if self._chat:
            body["messages"] = [{"role": "user", "content": self._texts[tuple(spec.prompt_token_ids)]}]
        else:
            body["prompt"] = spec.prompt_token_ids
        return body

    async def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk]:
        num_shown, usage = 0, None
        try:
            async with self._http.stream("POST", self._path, json=self._body(spec)) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    raise ClientError(f"HTTP {response.status_code}", detail)
                async for event in _events(response):
                    if (error := _stream_error(event)) is not None:
                        raise error
                    if event.get("choices") and _shows_text(event["choices"][0], self._chat):
                        num_shown += 1
                        yield Chunk(1)
                    usage = event.get("usage") or usage  # the last one (a cumulative count) wins
        except httpx.TransportError as e:
            raise ClientError(type(e).__name__, str(e)) from None
        if usage:
            yield Chunk(max(0, usage["completion_tokens"] - num_shown), prompt_tokens=usage.get("prompt_tokens"))

    async def close(self) -> None:
        await self._http.aclose()


async def _events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON payloads of a server-sent event stream, up to [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _stream_error(event: dict) -> ClientError | None:
    """An error sent as an event after the stream began: {"error": {...}} (OpenAI's shape, splitserve's)
    or vLLM's older {"object": "error", ...}."""
    error = event.get("error") if "error" in event else event if event.get("object") == "error" else None
    if error is None:
        return None
    what = (error.get("code") or error.get("type")) if isinstance(error, dict) else None
    return ClientError(f"stream error: {what or 'unknown'}", str(error)[:300])


def _shows_text(choice: dict, chat: bool) -> bool:
    if not chat:
        return bool(choice.get("text"))
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content"))


async def record_one(client: GenerationClient, spec: RequestSpec, t0: float | None = None) -> RequestRecord:
    """Send one request and record it: chunk arrival times from its send; start_s from t0 (the run's start)."""
    record = RequestRecord(len(spec.prompt_token_ids), spec.max_tokens)
    start = time.perf_counter()
    record.start_s = start - (start if t0 is None else t0)
    try:
        async for chunk in client.stream(spec):
            now = time.perf_counter() - start
            record.token_times_s.extend([now] * chunk.num_tokens)
            if record.ttft_s is None and chunk.num_tokens:
                record.ttft_s = now
            if chunk.queue_ms is not None:
                record.queue_ms = chunk.queue_ms
            if chunk.prompt_tokens is not None:
                record.prompt_tokens = chunk.prompt_tokens
        record.e2e_s = time.perf_counter() - start
    except ClientError as e:
        record.code = e.code
    return record


async def run_load(
    client: GenerationClient, cfg: WorkloadConfig, progress: Callable[[int, int], None] | None = None
) -> tuple[list[RequestRecord], float]:
    """Send the workload; returns (records in send order, wall seconds from first send to last end)."""
    specs = make_requests(cfg)
    offsets = arrival_offsets(cfg, len(specs))
    if offsets is not None and cfg.duration_s is not None:
        keep = [i for i, t in enumerate(offsets) if t < cfg.duration_s]
        specs, offsets = [specs[i] for i in keep], [offsets[i] for i in keep]
    await client.prepare(specs)
    done = 0
    t0 = time.perf_counter()

    async def tracked(coro):
        nonlocal done
        record = await coro
        done += 1
        if progress:
            progress(done, len(specs))
        return record

    if offsets is None:
        gate = asyncio.Semaphore(cfg.concurrency)

        async def gated(spec: RequestSpec) -> RequestRecord:
            async with gate:
                return await record_one(client, spec, t0)

        records = await asyncio.gather(*(tracked(gated(s)) for s in specs))
    else:

        async def scheduled(spec: RequestSpec, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await record_one(client, spec, t0)

        records = await asyncio.gather(*(tracked(scheduled(s, o)) for s, o in zip(specs, offsets)))
    return list(records), time.perf_counter() - t0


async def run_connected(
    connect: Connect, cfg: WorkloadConfig, progress: Callable[[int, int], None] | None = None
) -> tuple[list[RequestRecord], float]:
    """run_load through a new client from connect, closed afterwards."""
    client = connect(cfg)
    try:
        return await run_load(client, cfg, progress)
    finally:
        await client.close()


def grpc_connect(
    address: str, timeout_s: float = 600.0, credentials: GatewayCredentials = PLAINTEXT_GATEWAY
) -> Connect:
    """Connect for the splitserve gateway's gRPC API at address (HOST:PORT)."""
    return lambda cfg: GrpcClient(address, timeout_s, credentials)


async def run_grpc_load(
    address: str,
    cfg: WorkloadConfig,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 600.0,
    credentials: GatewayCredentials = PLAINTEXT_GATEWAY,
) -> tuple[list[RequestRecord], float]:
    """run_load through a GrpcClient to the gateway at address, closing the channel afterwards."""
    return await run_connected(grpc_connect(address, timeout_s, credentials), cfg, progress)


def send_workload(
    address: str, cfg: WorkloadConfig, timeout_s: float = 600.0, credentials: GatewayCredentials = PLAINTEXT_GATEWAY
) -> tuple[list[RequestRecord], float]:
    """Blocking run_grpc_load for the benchmarks, which report numbers only for runs where every
    request succeeded: raises RuntimeError with the failed requests' status codes otherwise."""
    records, seconds = asyncio.run(run_grpc_load(address, cfg, timeout_s=timeout_s, credentials=credentials))
    failed = Counter(r.code for r in records if not r.ok)
    if failed:
        raise RuntimeError(
            f"{failed.total()} of {len(records)} requests failed ({dict(failed)}); see the workers' logs"
        )
    return records, seconds


def progress_bar(done: int, total: int) -> None:
    """A one-line progress bar on stderr."""
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
