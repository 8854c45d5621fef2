"""The torch.distributed transport on its own: a real gloo pair group (both ranks in this process,
on threads), tags, bit-identical delivery in chunks with the checksum of each side, timeouts that
close a channel, and reconnecting."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch

from splitserve.services.disagg.transfer import chunks
from splitserve.services.disagg.transfer.base import ChannelSpec, TransferError, TransferFailure
from splitserve.services.disagg.transfer.checksum import RunningChecksum, checksum
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.services.engine.kv_cache.block_io import gather_blocks, scatter_blocks

SHAPE = (2, 2, 5, 8, 2, 16)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_concurrent_tagged_transfers_arrive_bit_identical(dtype):
    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=20), TorchDistSender(timeout_s=20)
        channel = receiver.channel_for("prefill-a")
        sent = {tag: torch.randn(SHAPE).to(dtype) for tag in (receiver.next_tag(channel) for _ in range(4))}
        buffers = {tag: torch.empty(SHAPE, dtype=dtype) for tag in sent}
        # Receives posted in one order, sends issued in the reverse one: tags keep them apart.
        recvs = [receiver.recv(channel, tag, buffers[tag]) for tag in sent]
        sends = [sender.send(channel, tag, sent[tag]) for tag in reversed(list(sent))]
        moved = await asyncio.gather(*recvs, *sends)
        assert receiver.channel_for("prefill-a") == channel  # reused, not rebuilt
        receiver.close(), sender.close()
        return sent, buffers, moved

    sent, buffers, moved = asyncio.run(main())
    received, sends = moved[: len(sent)], moved[len(sent) :][::-1]
    for tag, got, put in zip(sent, received, sends):
        assert torch.equal(buffers[tag].view(torch.uint8), sent[tag].view(torch.uint8))
        assert got.checksum == put.checksum == checksum(sent[tag])


def test_a_transfer_moves_in_chunks_gathered_and_scattered_as_they_go(monkeypatch):
    """Several chunks (small ones here): the sender fills each from its cache just before sending it,
    the receiver writes each into its own cache's blocks as it lands (drain), and both sides'
    checksums, computed chunk by chunk, equal the one-shot checksum of the blocks."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 3 * 1024)
    cache, ids = torch.randn(6, 2, 9, 8, 2, 16), [8, 0, 3, 5]
    want = gather_blocks(cache, ids)
    dest, dest_ids = torch.zeros(6, 2, 7, 8, 2, 16), [6, 1, 4, 2]
    filled: list[slice] = []
    drained: list[slice] = []

    def fill(rows: slice) -> None:
        filled.append(rows)
        gather_blocks(cache, ids, staging, rows)

    def drain(rows: slice) -> None:
        drained.append(rows)
        scatter_blocks(dest, dest_ids, buffer, rows)

    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=20), TorchDistSender(timeout_s=20)
        channel = receiver.channel_for("prefill-c")
        tag = receiver.next_tag(channel)
        recv = receiver.recv(channel, tag, buffer, drain)
        moved = await asyncio.gather(recv, sender.send(channel, tag, staging, fill))
        receiver.close(), sender.close()
        return moved

    staging, buffer = torch.full_like(want, float("nan")), torch.empty_like(want)
    got, put = asyncio.run(main())
    assert filled == drained == chunks.plan(want) and len(filled) > 3 and filled[-1].stop == 12
    assert torch.equal(buffer, want) and torch.equal(gather_blocks(dest, dest_ids), want)
    assert dest[:, :, [0, 3, 5]].abs().sum() == 0
    assert got.checksum == put.checksum == checksum(want)


def test_checksum_is_xxh3_64_and_pinned():
    assert checksum(torch.zeros(0)) == 0x2D06800538D394C2  # XXH3-64 of no bytes, from xxHash's own tests
    assert checksum(torch.arange(16, dtype=torch.int32)) == 8773583392624668237  # every process agrees
    assert checksum(torch.arange(16, dtype=torch.int32).view(4, 4).t()) == checksum(
        torch.arange(16, dtype=torch.int32).view(4, 4).t().contiguous()
    )  # memory order of the contiguous copy


def test_running_checksum_equals_the_whole_and_catches_swapped_chunks_and_flipped_bits():
    data = torch.randn(6, 2, 3, 4, 2, 8)
    rows = chunks.row_view(data)
    running = RunningChecksum()
    for part in (slice(0, 5), slice(5, 6), slice(6, 12)):
        running.update(rows[part])
    assert running.value == checksum(data)
    swapped = torch.cat([rows[6:12], rows[0:6]])  # the same bytes, chunks in the wrong order
    assert checksum(swapped) != checksum(data)
    flipped = data.clone()
    flipped.view(torch.int32).view(-1)[100] ^= 1  # one bit
    assert checksum(flipped) != checksum(data)


@pytest.mark.parametrize("shape", [(30, 2, 256, 16, 3, 64), (30, 2, 1, 16, 3, 64), (200, 2, 1, 1, 1, 1), (1, 2, 0, 4)])
def test_chunk_plan_covers_every_row_in_order_and_chunk_tags_stay_apart(shape):
    tensor = torch.empty(shape)
    parts = chunks.plan(tensor)
    assert parts[0].start == 0 and parts[-1].stop == chunks.row_view(tensor).shape[0]
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
    assert len(parts) <= 1 << chunks.CHUNK_BITS
    tags = {
        chunks.wire_tag(tag, i) for tag in (1, 2, chunks.TAG_SPACE, chunks.TAG_SPACE + 1) for i in range(len(parts))
    }
    assert len(tags) == 3 * len(parts)  # TAG_SPACE + 1 wraps onto tag 1, as far from it as tags can be
    assert 0 < min(tags) and max(tags) < 2**31


def test_timed_out_receive_closes_the_channel_and_a_new_one_works():
    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=1.5), TorchDistSender(timeout_s=1.5)
        channel = receiver.channel_for("prefill-b")
        sender.connect(channel)
        buffer = torch.empty(SHAPE)
        with pytest.raises(TransferError) as info:  # nobody sends tag 99
            await receiver.recv(channel, 99, buffer)
        assert info.value.reason is TransferFailure.TIMEOUT
        receiver.drop(channel)
        fresh = receiver.channel_for("prefill-b")
        assert fresh.key != channel.key
        data = torch.randn(SHAPE)
        await asyncio.gather(receiver.recv(fresh, 1, buffer), sender.send(fresh, 1, data))
        receiver.close(), sender.close()
        return data, buffer

    data, buffer = asyncio.run(main())
    assert torch.equal(data, buffer)


def test_gather_scatter_round_trip_through_scattered_block_ids():
    cache = torch.randn(3, 2, 10, 4, 2, 8)
    ids = [7, 2, 9]
    blocks = gather_blocks(cache, ids)
    assert blocks.shape == (3, 2, 3, 4, 2, 8) and blocks.is_contiguous()
    assert torch.equal(blocks[:, :, 1], cache[:, :, 2])
    other = torch.zeros_like(cache)
    scatter_blocks(other, [0, 5, 6], blocks)
    assert torch.equal(other[:, :, 5], cache[:, :, 2]) and torch.equal(other[:, :, 6], cache[:, :, 9])
    assert other[:, :, [1, 2, 3, 4, 7, 8, 9]].abs().sum() == 0


def test_staging_pool_reuses_buffers_by_power_of_two_class():
    from splitserve.services.engine.kv_cache.staging import StagingPool

    pool = StagingPool((3, 2, 4, 2, 8), torch.float32, max_cached_bytes=10 * 3 * 2 * 4 * 2 * 8 * 4)
    a = pool.acquire(3)
    assert a.tensor.shape == (3, 2, 3, 4, 2, 8) and a.tensor.is_contiguous() and a.capacity == 4
    cache = torch.randn(3, 2, 10, 4, 2, 8)
    gather_blocks(cache, [9, 1, 4], out=a.tensor)
    assert torch.equal(a.tensor[:, :, 2], cache[:, :, 4])
    pool.release(a)
    b = pool.acquire(4)  # same class: the same storage again, now viewed as 4 blocks
    assert b.storage.data_ptr() == a.storage.data_ptr() and b.tensor.shape[2] == 4
    c = pool.acquire(4)  # the class's free list is empty: fresh storage
    assert c.storage.data_ptr() != b.storage.data_ptr()
    pool.release(b), pool.release(c)  # the cap (10 blocks' bytes) keeps only the first
    assert pool.acquire(2).storage.data_ptr() != c.storage.data_ptr()


def test_in_process_transport_refuses_a_sender_without_the_channel_secret():
    from splitserve.services.disagg.transfer.inprocess import Hub, InProcessReceiver, InProcessSender

    async def main():
        hub = Hub(timeout_s=2)
        receiver, sender = InProcessReceiver(hub), InProcessSender(hub)
        channel = receiver.channel_for("prefill-a")
        buffer = torch.zeros(SHAPE)
        wrong = dataclasses.replace(channel, secret=bytes(32))
        outcomes = await asyncio.gather(
            receiver.recv(channel, 1, buffer), sender.send(wrong, 1, torch.randn(SHAPE)), return_exceptions=True
        )
        return outcomes, buffer

    outcomes, buffer = asyncio.run(main())
    assert all(isinstance(e, TransferError) and e.reason is TransferFailure.AUTH for e in outcomes), outcomes
    assert not buffer.any()
    spec = ChannelSpec("a", "k", b"\x01" * 32)
    assert repr(spec.secret) not in repr(spec)  # a logged channel does not give its secret away


# --- choosing the wire, and the order of an NCCL channel (what runs without a GPU) ----------------


def test_the_receiver_picks_nccl_for_a_cuda_cache_only_when_torch_has_nccl(monkeypatch):
    from splitserve.services.disagg.transfer import nccl
    from splitserve.services.disagg.transfer.base import Backend

    assert nccl.backend_for(torch.device("cpu")) is Backend.GLOO
    monkeypatch.setattr(nccl.dist, "is_nccl_available", lambda: False)
    assert nccl.backend_for(torch.device("cuda", 0)) is Backend.GLOO  # a CUDA cache, no NCCL: gloo
    monkeypatch.setattr(nccl.dist, "is_nccl_available", lambda: True)
    assert nccl.backend_for(torch.device("cuda", 1)) is Backend.NCCL
    assert nccl.backend_for(torch.device("cpu")) is Backend.GLOO

    receiver = TorchDistReceiver(timeout_s=2, device=torch.device("cpu"))
    assert receiver.channel_for("prefill-a").backend is Backend.GLOO
    receiver.close()


def test_tags_count_per_channel_from_one():
    receiver = TorchDistReceiver(timeout_s=2)
    a, b = receiver.channel_for("prefill-a"), receiver.channel_for("prefill-b")
    assert [receiver.next_tag(a) for _ in range(3)] == [1, 2, 3]
    assert [receiver.next_tag(b) for _ in range(2)] == [1, 2]  # each channel is its own order
    receiver.drop(a)
    assert receiver.next_tag(receiver.channel_for("prefill-a")) == 1  # a new channel starts again
    receiver.close()


def test_the_issue_order_lets_each_tag_go_only_after_the_ones_before_it():
    import threading

    from splitserve.services.disagg.transfer.order import IssueOrder

    order, issued = IssueOrder(), []

    def transfer(tag: int) -> None:
        order.wait_turn(tag, timeout_s=10)
        issued.append(tag)
        order.issued(tag)

    threads = [threading.Thread(target=transfer, args=(tag,)) for tag in (4, 2, 5, 1, 3)]  # posted out of order
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert issued == [1, 2, 3, 4, 5] and order.next_tag == 6


def test_a_tag_that_never_comes_times_out_the_ones_behind_it_and_a_broken_order_frees_them():
    import threading

    from splitserve.services.disagg.transfer.order import IssueOrder, OrderTimeout

    order = IssueOrder()
    with pytest.raises(OrderTimeout, match="waited for transfer 1"):
        order.wait_turn(2, timeout_s=0.05)  # tag 1's handoff failed on the other side
    errors: list[Exception] = []

    def waiter() -> None:
        try:
            order.wait_turn(3, timeout_s=30)
        except OrderTimeout as e:
            errors.append(e)

    thread = threading.Thread(target=waiter)
    thread.start()
    order.break_order()  # the channel failed: nobody waits out the 30 s
    thread.join(timeout=5)
    assert not thread.is_alive() and "channel failed" in str(errors[0])


def test_a_channel_keeps_its_backend_across_the_handoff_rpc_and_the_rank_pipes():
    from splitserve.protos.v1 import worker_pb2 as pb
    from splitserve.services.disagg.prefill_client import channel_from_proto, channel_to_proto
    from splitserve.services.disagg.rank_transfers import (
        PieceReport,
        channel_from_wire,
        channel_to_wire,
        report_from_wire,
        report_to_wire,
    )
    from splitserve.services.disagg.transfer.base import Backend
    from splitserve.services.engine.ranks import decode, encode

    for backend in Backend:
        spec = ChannelSpec("10.0.0.1:5", "k", b"\x07" * 32, backend)
        assert channel_from_proto(channel_to_proto(spec)) == spec
        assert channel_from_wire(*decode(encode(1, *channel_to_wire(spec))).arrays) == spec
    old = pb.KVChannel(store_address="a:1", key="k", secret=b"s")  # a decode worker from before the field
    assert channel_from_proto(old).backend is Backend.GLOO
    # a backend this worker does not know (a newer peer's): the caller's error, not a KeyError (a Prefill
    # call ended UNKNOWN in one process; in an engine core it would have ended the command reader)
    with pytest.raises(ValueError, match="KV backend 99"):
        channel_from_proto(pb.KVChannel(store_address="a:1", key="k", secret=b"s", backend=99))
    report = PieceReport(123, 2**64 - 5, 0.25)  # a checksum past int64: its bits survive the pipe
    assert report_from_wire(decode(encode(1, *report_to_wire(report))).arrays) == report


def test_the_device_checksum_is_exact_in_chunks_and_catches_flips_and_swaps(monkeypatch):
    from splitserve.services.disagg.transfer import checksum as module

    data = torch.randn(4, 2, 3, 8, 2, 16)
    whole = module.device_checksum(data)
    monkeypatch.setattr(module, "_DEVICE_CHUNK_WORDS", 100)  # many chunks: the same sum
    assert module.device_checksum(data) == whole
    flipped = data.clone()
    flipped.view(torch.int32).view(-1)[7] ^= 1 << 30
    swapped = data.clone()
    swapped[:, :, [0, 2]] = data[:, :, [2, 0]]
    assert len({whole, module.device_checksum(flipped), module.device_checksum(swapped)}) == 3
    assert module.device_checksum(torch.zeros(3)) != module.device_checksum(torch.zeros(4))  # length counts


def test_a_send_cancelled_while_its_bytes_move_ends_after_the_transfer_and_the_channel_goes_on():
    """gloo reads the sender's buffer until the transfer ends: a cancel (the Prefill call is gone)
    must not return (and let the caller release that buffer) before then. The receiver gets the
    bytes, identical, and the channel serves the next transfer."""
    entered, gate = threading.Event(), threading.Event()
    data = torch.randn(SHAPE)

    def fill(rows: slice) -> None:
        entered.set()
        gate.wait(timeout=60)  # held here while the cancel comes
        chunks.row_view(staging)[rows] = chunks.row_view(data)[rows]

    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=20), TorchDistSender(timeout_s=20)
        channel = receiver.channel_for("prefill-d")
        buffer = torch.empty(SHAPE)
        recv = asyncio.ensure_future(receiver.recv(channel, 1, buffer))
        send = asyncio.ensure_future(sender.send(channel, 1, staging, fill))
        await asyncio.to_thread(entered.wait, 60)
        send.cancel()
        for _ in range(20):  # the cancel is delivered and handled; the transfer cannot end: its fill is held
            await asyncio.sleep(0)
        ended_early = send.done()
        gate.set()
        await recv
        with pytest.raises(asyncio.CancelledError):
            await send
        again, buffer2 = torch.randn(SHAPE), torch.empty(SHAPE)
        await asyncio.gather(receiver.recv(channel, 2, buffer2), sender.send(channel, 2, again))
        receiver.close(), sender.close()
        return ended_early, buffer, again, buffer2

    staging = torch.full(SHAPE, float("nan"))
    ended_early, buffer, again, buffer2 = asyncio.run(main())
    assert not ended_early
    assert torch.equal(buffer, data) and torch.equal(buffer2, again)
