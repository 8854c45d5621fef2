"""Publishes this worker's block-pool events to the gateway's prefix index.

Batches go out every interval_s when there are events, and at least every heartbeat_s (an empty
batch is the heartbeat), each with the next sequence number under this process's instance id.
Events and snapshots are read between engine steps, so they wait for the step in flight; heartbeats
come from a task of their own that never waits for the engine: a long step on a busy CPU (a big
prefill, several workers on few cores) once held them past the index's TTL and live workers were
purged. Sequence numbers are given at sending time, under one lock, so the wire order is theirs.
The first batch, and the one after any refusal (the index saw a gap, a restart of either side, or
lost its state) or failed call, is a snapshot of every cached block: taken between engine steps
together with draining the pending events, so nothing is counted twice or lost.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable

import grpc

from splitserve.common.security import OPEN_CLUSTER
from splitserve.common.wire import kv_events_to_proto
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.engine.core_client import EngineCoreClient

log = logging.getLogger("splitserve.services.worker")


class KVEventPublisher:
    def __init__(
        self,
        port: EngineCoreClient,
        gateway: str,
        address: str,
        model: str,
        register: Callable[[], Awaitable[None]],
        channel_factory: Callable[[str], grpc.aio.Channel] = OPEN_CLUSTER.gateway_channel,
        interval_s: float = 0.1,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.port, self.gateway, self.address, self.model = port, gateway, address, model
        self.register = register  # called when the gateway no longer knows this worker (it restarted)
        self.channel_factory = channel_factory  # address -> a channel with the cluster's credentials
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self.instance_id = uuid.uuid4().hex
        self.seq = 0
        self.num_snapshots = 0
        self._need_snapshot = True
        self._sending = asyncio.Lock()  # one batch on the wire at a time, in seq order
        self._last_sent = float("-inf")  # event loop time of the last batch sent

    async def run(self) -> None:
        async with self.channel_factory(self.gateway) as channel:
            stub = pb_grpc.RegistryStub(channel)
            await asyncio.gather(self._publish(stub), self._beat(stub))

    async def _publish(self, stub: pb_grpc.RegistryStub) -> None:
        while True:
            request = await self._next_batch()
            if request is not None:
                await self._send(stub, request)
            await asyncio.sleep(self.interval_s)

    async def _beat(self, stub: pb_grpc.RegistryStub) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.heartbeat_s / 4)
            if loop.time() - self._last_sent >= self.heartbeat_s:
                await self._send(stub, self._request(block_size=self.port.block_size))

    async def _next_batch(self) -> pb.PublishKVEventsRequest | None:
        block_size = self.port.block_size
        if self._need_snapshot:
            hashes, _ = await self.port.kv_snapshot()
            self._need_snapshot = False
            self.num_snapshots += 1
            return self._request(is_snapshot=True, snapshot_block_hashes=hashes, block_size=block_size)
        events = await self.port.drain_kv_events()
        if not events:
            return None
        return self._request(events=kv_events_to_proto(events), block_size=block_size)

    def _request(self, **fields) -> pb.PublishKVEventsRequest:
        return pb.PublishKVEventsRequest(address=self.address, instance_id=self.instance_id, model=self.model, **fields)

    async def _send(self, stub: pb_grpc.RegistryStub, request: pb.PublishKVEventsRequest) -> None:
        async with self._sending:
            self.seq += 1
            request.seq = self.seq
            self._last_sent = asyncio.get_running_loop().time()
            try:
                reply = await stub.PublishKVEvents(request, timeout=2.0)
            except grpc.aio.AioRpcError as e:  # this batch is lost: the index must resync
                log.debug("publishing KV events to %s failed: %s", self.gateway, e.code().name)
                self._need_snapshot = True
                return
            if reply.resync:
                log.info("prefix index asked for a snapshot (batch %d)", request.seq)
                self._need_snapshot = True
            if reply.register:
                log.info("gateway %s does not know this worker (restarted?); registering again", self.gateway)
                await self.register()
