"""How a decode worker reaches prefill workers over gRPC (the Worker service's Prefill RPC, and
GetLoad for their size), and the handoff's wire form (the job, FirstToken, TransferDone) on both
sides. A job of whole blocks (both tiers of size 1) goes out as it always did: channel and tag, no
pieces."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from splitserve.common.security import OPEN_CLUSTER
from splitserve.common.tracing import SpanKind, ended, trace_metadata, tracer
from splitserve.common.wire import PEER_CHANNEL_OPTIONS, logprobs_to_proto
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.disagg.handoff import (
    FirstToken,
    HandoffEvent,
    HandoffJob,
    PieceJob,
    PrefillClient,
    SendStarted,
    TransferDone,
)
from splitserve.services.disagg.plan import Piece
from splitserve.services.disagg.transfer.base import Backend, ChannelSpec
from splitserve.services.engine.core_wire import logprobs_from_proto

PEER_TIMEOUT_S = 10.0  # GetLoad of a prefill worker (its size, once per peer)


_BACKENDS = {Backend.GLOO: pb.KV_BACKEND_GLOO, Backend.NCCL: pb.KV_BACKEND_NCCL}
_FROM_PROTO = {**{v: k for k, v in _BACKENDS.items()}, pb.KV_BACKEND_UNSPECIFIED: Backend.GLOO}


def channel_to_proto(channel: ChannelSpec) -> pb.KVChannel:
    backend = _BACKENDS[channel.backend]
    return pb.KVChannel(store_address=channel.address, key=channel.key, secret=channel.secret, backend=backend)


def channel_from_proto(msg: pb.KVChannel) -> ChannelSpec:
    backend = _FROM_PROTO.get(msg.backend)
    if backend is None:  # an open enum: a newer peer's value
        raise ValueError(f"KV backend {msg.backend} is unknown to this worker (known: {sorted(_FROM_PROTO)})")
    return ChannelSpec(msg.store_address, msg.key, msg.secret, backend)


def job_to_proto(job: HandoffJob, wire: pb.WorkerGenerateRequest) -> pb.PrefillRequest:
    msg = pb.PrefillRequest(request=wire, num_skip_blocks=job.num_skip_blocks, kv_layout=job.kv_layout)
    msg.request.ClearField("prefill_address")  # the prefill worker runs the prompt itself
    if job.is_whole_blocks:
        (only,) = job.pieces
        msg.channel.CopyFrom(channel_to_proto(only.channel))
        msg.transfer_tag = only.tag
        return msg
    msg.decode_tensor_parallel_size = job.decode_size
    for p in job.pieces:
        heads = p.piece.heads
        msg.pieces.append(
            pb.KVPiece(
                src_rank=p.piece.src_rank,
                dst_rank=p.piece.dst_rank,
                first_kv_head=heads.start,
                num_kv_heads=len(heads),
                channel=channel_to_proto(p.channel),
                transfer_tag=p.tag,
            )
        )
    return msg


def job_from_proto(msg: pb.PrefillRequest, num_kv_heads: int) -> HandoffJob:
    """num_kv_heads: the receiving worker's (a job of whole blocks carries every head)."""
    pieces = tuple(
        PieceJob(
            Piece(p.src_rank, p.dst_rank, range(p.first_kv_head, p.first_kv_head + p.num_kv_heads)),
            channel_from_proto(p.channel),
            p.transfer_tag,
        )
        for p in msg.pieces
    )
    if not pieces:
        pieces = (PieceJob(Piece(0, 0, range(num_kv_heads)), channel_from_proto(msg.channel), msg.transfer_tag),)
    return HandoffJob(pieces, msg.num_skip_blocks, msg.kv_layout, msg.decode_tensor_parallel_size or 1)


def event_to_proto(event: HandoffEvent) -> pb.PrefillResponse:
    if isinstance(event, SendStarted):
        return pb.PrefillResponse(send_started=pb.SendStarted(num_blocks=event.num_blocks))
    if isinstance(event, FirstToken):
        logprobs = logprobs_to_proto([event.logprobs] if event.logprobs is not None else None)
        return pb.PrefillResponse(
            first_token=pb.FirstToken(
                token_id=event.token_id,
                logprobs=logprobs,
                num_blocks=event.num_blocks,
                queue_ms=event.queue_ms,
                compute_ms=event.compute_ms,
            )
        )
    return pb.PrefillResponse(
        transfer_done=pb.TransferDone(
            num_blocks=event.num_blocks,
            num_bytes=event.num_bytes,
            send_ms=event.seconds * 1e3,
            piece_checksums_xxh3=event.checksums,
        )
    )


def event_from_proto(msg: pb.PrefillResponse) -> HandoffEvent:
    kind = msg.WhichOneof("event")
    if kind == "send_started":
        return SendStarted(msg.send_started.num_blocks)
    if kind == "first_token":
        f = msg.first_token
        logprobs = logprobs_from_proto(f.logprobs)
        first_logprobs = logprobs[0] if logprobs else None
        return FirstToken(f.token_id, first_logprobs, f.num_blocks, f.queue_ms, f.compute_ms)
    d = msg.transfer_done
    return TransferDone(d.num_blocks, d.num_bytes, tuple(d.piece_checksums_xxh3), d.send_ms / 1e3)


class GrpcPrefillClient(PrefillClient):
    """Reaches prefill workers over their Worker service (one channel per address, reused)."""

    def __init__(self, channel_factory: Callable[..., grpc.aio.Channel] = OPEN_CLUSTER.worker_channel) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._channel = channel_factory  # (address, options) -> a channel with the cluster's credentials

    def _stub(self, address: str) -> pb_grpc.WorkerStub:
        if address not in self._channels:
            self._channels[address] = self._channel(address, PEER_CHANNEL_OPTIONS)
        return pb_grpc.WorkerStub(self._channels[address])

    async def prefill(self, peer: str, wire: pb.WorkerGenerateRequest, job: HandoffJob) -> AsyncIterator[HandoffEvent]:
        # Forwarded as received (the prefill worker validates it again, as it would any request).
        msg = job_to_proto(job, wire)
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
                        span.add_event("first token" if isinstance(event, FirstToken) else "send started")
                    yield event
            finally:
                call.cancel()  # no-op once finished

    async def tensor_parallel_size(self, peer: str) -> int:
        load = await self._stub(peer).GetLoad(pb.GetLoadRequest(), timeout=PEER_TIMEOUT_S)
        return load.tensor_parallel_size or 1

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=None)
