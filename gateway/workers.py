"""The gateway's view of its workers: registration, health checks and load, one owner for all.

`WorkerHandle.outstanding` (requests this gateway has in flight on a worker) is changed only here,
through `WorkerSet.lease()`: the proxy holds a lease for as long as a worker works on a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Self

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.roles import Role
from splitserve.common.security import OPEN_CLUSTER
from splitserve.common.wire import PEER_CHANNEL_OPTIONS
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("splitserve.gateway")


@dataclass(eq=False)
class WorkerHandle:
    worker_id: str
    address: str
    role: Role
    model: str
    max_model_len: int
    metrics_address: str
    block_size: int  # 0 until known (registration or the first load report)
    channel: grpc.aio.Channel
    stub: pb_grpc.WorkerStub
    vocab_size: int = 0  # token ids must be below it; 0 when unknown (a worker named by --worker at start)
    healthy: bool = True
    outstanding: int = 0  # requests this gateway has in flight on the worker; changed only by a Lease
    failures: int = 0  # consecutive failed health checks
    unhealthy_since: float | None = None  # WorkerSet's clock when it last stopped being healthy
    load: pb.LoadReport = field(default_factory=pb.LoadReport)

    @property
    def role_name(self) -> str:
        return self.role.value


class Lease:
    """Counts one request in `outstanding` on each of its workers until released: the router
    weighs those counts, and a leaving worker's channel closes once its count is back to 0."""

    def __init__(self, workers: Iterable[WorkerHandle]) -> None:
        self._held = list(workers)
        for w in self._held:
            w.outstanding += 1

    def release(self, worker: WorkerHandle) -> None:
        """Ends the request on one worker early (a prefill worker, whose part ends at the first token)."""
        if worker in self._held:
            self._held.remove(worker)
            worker.outstanding -= 1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for w in self._held:
            w.outstanding -= 1
        self._held.clear()


# Called with a forgotten worker's address (the prefix index drops its blocks).
OnForgotten = Callable[[str], Awaitable[None]]


class WorkerSet:
    FAILURES_BEFORE_UNHEALTHY = 2

    def __init__(
        self,
        check_interval_s: float = 1.0,
        check_timeout_s: float = 1.0,
        channel_factory: Callable[..., grpc.aio.Channel] = OPEN_CLUSTER.worker_channel,
        forget_after_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """forget_after_s: a worker unhealthy this long is dropped as if it had deregistered (it died
        without doing so: SIGKILL, OOM); a live one registers again when its heartbeat is refused."""
        self._workers: dict[str, WorkerHandle] = {}
        self._channel = channel_factory  # (address, options) -> a channel carrying the cluster's credentials
        self._ids = itertools.count(1)
        self.check_interval_s = check_interval_s
        self.check_timeout_s = check_timeout_s
        self.forget_after_s = forget_after_s
        self._clock = clock

    def add(self, r: pb.RegisterWorkerRequest) -> WorkerHandle:
        old = self._workers.pop(r.address, None)
        if old is not None:  # a restarted worker on the same address
            asyncio.ensure_future(old.channel.close())
        channel = self._channel(r.address, PEER_CHANNEL_OPTIONS)
        handle = WorkerHandle(
            f"w{next(self._ids)}",
            r.address,
            Role.from_proto(r.role) or Role.UNIFIED,
            r.model,
            r.max_model_len,
            r.metrics_address,
            r.block_size,
            channel,
            pb_grpc.WorkerStub(channel),
            vocab_size=r.vocab_size,
        )
        self._workers[r.address] = handle
        log.info("worker %s registered at %s (%s, %s)", handle.worker_id, r.address, handle.role_name, r.model)
        return handle

    async def remove(self, address: str) -> bool:
        handle = self._workers.pop(address, None)
        if handle is None:
            return False
        log.info("worker %s at %s left", handle.worker_id, address)
        # A draining worker finishes what it runs: keep the channel for the calls still on it
        # (closing it cancels them, and a cancelled stream can hang its reader until the deadline).
        asyncio.ensure_future(self._close_when_idle(handle))
        return True

    async def _close_when_idle(self, handle: WorkerHandle, timeout_s: float = 300.0) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while handle.outstanding and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
        await handle.channel.close(grace=1.0)

    def get(self, address: str) -> WorkerHandle | None:
        return self._workers.get(address)

    def all(self) -> list[WorkerHandle]:
        return list(self._workers.values())

    def is_live(self, address: str) -> bool:
        """Whether the worker at address is registered and passes its health checks."""
        handle = self._workers.get(address)
        return handle is not None and handle.healthy

    def healthy(self, model: str | None = None) -> list[WorkerHandle]:
        return [w for w in self._workers.values() if w.healthy and (model is None or w.model == model)]

    def lease(self, *workers: WorkerHandle) -> Lease:
        """`with workers.lease(a, b) as lease:` counts a request on a and b until the block ends."""
        return Lease(workers)

    def max_model_len(self, model: str) -> int:
        """The context the healthy workers of model accept (0 while none is known)."""
        return min((w.max_model_len for w in self.healthy(model)), default=0)

    def vocab_size(self, model: str) -> int:
        """Token ids the healthy workers of model accept are below this (0 while none is known)."""
        return min((w.vocab_size for w in self.healthy(model) if w.vocab_size), default=0)

    def mark_failed(self, handle: WorkerHandle) -> None:
        """A call to the worker failed at the transport level: stop routing to it until it recovers."""
        self._mark_unhealthy(handle)
        handle.failures = max(handle.failures, self.FAILURES_BEFORE_UNHEALTHY)

    def mark_healthy(self, handle: WorkerHandle) -> None:
        if not handle.healthy:
            log.info("worker %s at %s is healthy again", handle.worker_id, handle.address)
        handle.failures, handle.healthy, handle.unhealthy_since = 0, True, None

    def _mark_unhealthy(self, handle: WorkerHandle) -> None:
        handle.healthy = False
        if handle.unhealthy_since is None:
            handle.unhealthy_since = self._clock()

    async def run_health_checks(self, on_forgotten: OnForgotten) -> None:
        while True:
            await self.check_all(on_forgotten)
            await asyncio.sleep(self.check_interval_s)

    async def check_all(self, on_forgotten: OnForgotten) -> None:
        """One round of health checks; then forgets the workers unhealthy for forget_after_s or more."""
        await asyncio.gather(*(self._check(w) for w in self.all()))
        for handle in self.all():
            since = handle.unhealthy_since
            if since is not None and self._clock() - since >= self.forget_after_s and await self.remove(handle.address):
                log.warning(
                    "worker %s at %s unhealthy for %.0f s: forgotten (it registers again if it comes back)",
                    handle.worker_id,
                    handle.address,
                    self._clock() - since,
                )
                await on_forgotten(handle.address)

    async def _check(self, handle: WorkerHandle) -> None:
        try:
            reply = await health_pb2_grpc.HealthStub(handle.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.check_timeout_s
            )
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            if serving:
                handle.load = await handle.stub.GetLoad(pb.GetLoadRequest(), timeout=self.check_timeout_s)
                handle.block_size = handle.block_size or handle.load.block_size
        except grpc.aio.AioRpcError:
            serving = False
        if serving:
            self.mark_healthy(handle)
            return
        handle.failures += 1
        if handle.failures >= self.FAILURES_BEFORE_UNHEALTHY and handle.healthy:
            log.warning(
                "worker %s at %s failed %d health checks; no more traffic to it",
                handle.worker_id,
                handle.address,
                handle.failures,
            )
            self._mark_unhealthy(handle)

    async def close(self) -> None:
        for handle in self.all():
            await handle.channel.close(grace=None)
        self._workers.clear()
