"""Sends a workload to a gateway and records what each request saw.

The client side is pluggable (GenerationClient): gRPC today; the OpenAI HTTP API can plug in later.
"""

from __future__ import annotations

import asyncio
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from splitserve.common.security import PLAINTEXT_GATEWAY, GatewayCredentials
from splitserve.experiments.stats import RequestRecord
from splitserve.experiments.workload import RequestSpec, WorkloadConfig, arrival_offsets, make_requests
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class Chunk:
    num_tokens: int
    queue_ms: float | None = None  # on the last chunk


class GenerationClient(ABC):
    @abstractmethod
    def stream(self, spec: RequestSpec) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; raise grpc.aio.AioRpcError (or ClientError) on failure."""

    async def close(self) -> None:
        pass


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
        async for chunk in self._stub.Generate(request, timeout=self.timeout_s):
            last = chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            yield Chunk(len(chunk.token_ids), chunk.timings.queue_ms if last else None)

    async def close(self) -> None:
        await self._channel.close()


async def _one(client: GenerationClient, spec: RequestSpec, t0: float) -> RequestRecord:
    record = RequestRecord(len(spec.prompt_token_ids), spec.max_tokens)
    start = time.perf_counter()
    record.start_s = start - t0
    try:
        async for chunk in client.stream(spec):
            now = time.perf_counter() - start
            record.token_times_s.extend([now] * chunk.num_tokens)
            if record.ttft_s is None and chunk.num_tokens:
                record.ttft_s = now
            if chunk.queue_ms is not None:
                record.queue_ms = chunk.queue_ms
        record.e2e_s = time.perf_counter() - start
    except grpc.aio.AioRpcError as e:
        record.code = e.code().name
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
                return await _one(client, spec, t0)

        records = await asyncio.gather(*(tracked(gated(s)) for s in specs))
    else:

        async def scheduled(spec: RequestSpec, offset: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            return await _one(client, spec, t0)

        records = await asyncio.gather(*(tracked(scheduled(s, o)) for s, o in zip(specs, offsets)))
    return list(records), time.perf_counter() - t0


async def run_grpc_load(
    address: str,
    cfg: WorkloadConfig,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 600.0,
    credentials: GatewayCredentials = PLAINTEXT_GATEWAY,
) -> tuple[list[RequestRecord], float]:
    """run_load through a GrpcClient to the gateway at address, closing the channel afterwards."""
    client = GrpcClient(address, timeout_s, credentials)
    try:
        return await run_load(client, cfg, progress)
    finally:
        await client.close()


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
