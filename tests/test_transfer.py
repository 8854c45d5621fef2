"""The torch.distributed transport on its own: a real gloo pair group (both ranks in this process,
on threads), tags, bit-identical delivery, timeouts that close a channel, and reconnecting."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from splitserve.disagg.transfer.base import ChannelSpec, TransferError, TransferFailure
from splitserve.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.engine.kv_cache.block_io import checksum, gather_blocks, scatter_blocks

pytestmark = pytest.mark.unit

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
        await asyncio.gather(*recvs, *sends)
        assert receiver.channel_for("prefill-a") == channel  # reused, not rebuilt
        receiver.close(), sender.close()
        return sent, buffers

    sent, buffers = asyncio.run(main())
    for tag in sent:
        assert torch.equal(buffers[tag].view(torch.uint8), sent[tag].view(torch.uint8))
        assert checksum(buffers[tag]) == checksum(sent[tag])


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
    from splitserve.engine.kv_cache.staging import StagingPool

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
    from splitserve.disagg.transfer.inprocess import Hub, InProcessReceiver, InProcessSender

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
