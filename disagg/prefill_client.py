"""How a decode worker reaches prefill workers over gRPC (the Worker service's Prefill RPC), and
the handoff events' wire form (FirstToken, TransferDone) on both sides."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from splitserve.common.security import OPEN_CLUSTER
from splitserve.common.tracing import SpanKind, ended, trace_metadata, tracer
from splitserve.common.wire import (
    PEER_CHANNEL_OPTIONS,
    logprobs_from_proto,
    logprobs_to_proto,
)
from splitserve.disagg.decode import PrefillClient
from splitserve.disagg.handoff import FirstToken, HandoffEvent, HandoffJob, TransferDone
from splitserve.engine.request import Request
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc


def event_to_proto(event: HandoffEvent) -> pb.PrefillResponse:
    if isinstance(event, FirstToken):
        logprobs = logprobs_to_proto([event.logprobs] if event.logprobs is not None else None)
        return pb.PrefillResponse(
            first_token=pb.FirstToken(
                token_id=event.token_id,
                logprobs=logprobs,
                sampler_state=event.sampler_state or b"",
                num_blocks=event.num_blocks,
                queue_ms=event.queue_ms,
                compute_ms=event.compute_ms,
            )
        )
    return pb.PrefillResponse(
        transfer_done=pb.TransferDone(
            num_blocks=event.num_blocks,
            num_bytes=event.num_bytes,
            checksum_crc32=event.checksum,
            send_ms=event.seconds * 1e3,
        )
    )


def event_from_proto(msg: pb.PrefillResponse) -> HandoffEvent:
    if msg.WhichOneof("event") == "first_token":
        f = msg.first_token
        logprobs = logprobs_from_proto(f.logprobs)
        first_logprobs = logprobs[0] if logprobs else None
        return FirstToken(f.token_id, first_logprobs, f.sampler_state or None, f.num_blocks, f.queue_ms, f.compute_ms)
    d = msg.transfer_done
    return TransferDone(d.num_blocks, d.num_bytes, d.checksum_crc32, d.send_ms / 1e3)


class GrpcPrefillClient(PrefillClient):
    """Reaches prefill workers over their Worker service (one channel per address, reused)."""

    def __init__(self, channel_factory: Callable[..., grpc.aio.Channel] = OPEN_CLUSTER.worker_channel) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._channel = channel_factory  # (address, options) -> a channel with the cluster's credentials

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        if address not in self._channels:
            self._channels[address] = self._channel(address, PEER_CHANNEL_OPTIONS)
        return pb_grpc.WorkerStub(self._channels[address])

    async def prefill(
        self, peer: str, request: Request, wire: pb.WorkerGenerateRequest | None, job: HandoffJob
    ) -> AsyncIterator[HandoffEvent]:
        if wire is None:
            raise ValueError("the gRPC prefill client forwards the request as this worker received it; got none")
        # Forwarded as received (the prefill worker validates it again, as it would any request).
        msg = pb.PrefillRequest(
            request=wire,
            transfer_tag=job.tag,
            num_skip_blocks=job.num_skip_blocks,
            kv_layout=job.kv_layout,
            channel=pb.KVChannel(store_address=job.channel.address, key=job.channel.key, secret=job.channel.secret),
        )
        # A child of the current span (the request's); ends at TransferDone, after which nobody reads on.
        span = tracer.start_span("decode.prefill_rpc", kind=SpanKind.CLIENT, attributes={"splitserve.peer": peer})
        with ended(span):
            call = self._stub(peer).Prefill(msg, metadata=trace_metadata(span))
            try:
                async for response in call:
                    event = event_from_proto(response)
                    if isinstance(event, TransferDone):
                        span.end()
                    else:
                        span.add_event("first token")
                    yield event
            finally:
                call.cancel()  # no-op once finished

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=None)
