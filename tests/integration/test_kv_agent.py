"""The KV transport workers use (services/disagg/transfer/isolated.py): torch_dist in a KV agent process per
side, bytes through shared memory. The contract as in one process (bytes, checksums, drain, fill),
and what one process could not give: its agent dying fails the transfers on it, never the worker, and
the next channel works on a new agent at the same store address."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from splitserve.services.disagg.transfer import chunks, isolated
from splitserve.services.disagg.transfer.base import TransferError, TransferFailure
from splitserve.services.disagg.transfer.checksum import checksum
from splitserve.services.disagg.transfer.isolated import AgentReceiver, AgentSender

SHAPE = (2, 2, 3, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
TIMEOUT_S = 20.0


@pytest.fixture
def pair():
    receiver, sender = AgentReceiver(timeout_s=TIMEOUT_S), AgentSender(timeout_s=TIMEOUT_S)
    yield receiver, sender
    receiver.close(), sender.close()


async def _move(receiver: AgentReceiver, sender: AgentSender, data: torch.Tensor, peer: str = "prefill-a"):
    channel = receiver.channel_for(peer)
    buffer, tag = torch.empty_like(data), receiver.next_tag(channel)
    received, sent = await asyncio.gather(receiver.recv(channel, tag, buffer), sender.send(channel, tag, data))
    return channel, buffer, received, sent


def test_transfers_through_the_agents_arrive_whole_with_matching_checksums(pair):
    receiver, sender = pair
    drained: list[slice] = []
    data, staging = torch.randn(SHAPE, dtype=torch.bfloat16), torch.full(SHAPE, float("nan"), dtype=torch.bfloat16)

    def fill(rows: slice) -> None:  # as held_reader: the rows are written only when the agent asks
        chunks.row_view(staging)[rows] = chunks.row_view(data)[rows]

    async def main():
        channel, first, received, sent = await _move(receiver, sender, torch.arange(96.0).view(2, 2, 3, 4, 2))
        assert received.checksum == sent.checksum == checksum(first)
        tag, buffer = receiver.next_tag(channel), torch.empty(SHAPE, dtype=torch.bfloat16)
        received, sent = await asyncio.gather(
            receiver.recv(channel, tag, buffer, drained.append), sender.send(channel, tag, staging, fill)
        )
        return first, buffer, received, sent

    first, buffer, received, sent = asyncio.run(main())
    assert torch.equal(first, torch.arange(96.0).view(2, 2, 3, 4, 2))
    assert torch.equal(buffer, data) and received.checksum == sent.checksum == checksum(data)
    assert [r for s in drained for r in range(s.start, s.stop)] == list(range(SHAPE[0] * SHAPE[1]))


def _kill(agent) -> int:
    pid = agent.pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    return pid


def test_a_receiver_whose_agent_dies_fails_its_transfer_and_names_a_new_channel_at_the_same_address(pair):
    receiver, sender = pair

    async def main():
        channel, _, _, _ = await _move(receiver, sender, torch.randn(SHAPE))
        waiting = asyncio.ensure_future(receiver.recv(channel, receiver.next_tag(channel), torch.empty(SHAPE)))
        await asyncio.sleep(0)
        dead = _kill(receiver.agent)
        with pytest.raises(TransferError) as failed:
            await waiting
        assert failed.value.reason is TransferFailure.PEER_LOST
        with pytest.raises(TransferError) as closed:  # a channel of the dead agent
            await receiver.recv(channel, receiver.next_tag(channel), torch.empty(SHAPE))
        assert closed.value.reason is TransferFailure.CLOSED
        data = torch.randn(SHAPE)
        again, buffer, received, sent = await _move(receiver, sender, data)
        return dead, channel, again, buffer, data

    dead, channel, again, buffer, data = asyncio.run(main())
    assert again.key != channel.key and again.address == channel.address == receiver.address
    assert torch.equal(buffer, data) and receiver.agent.pid() not in (None, dead)


def test_a_sender_whose_agent_dies_fails_its_send_and_refuses_the_channels_it_had_joined(pair):
    receiver, sender = pair

    async def main():
        channel, _, _, _ = await _move(receiver, sender, torch.randn(SHAPE))
        _kill(sender.agent)
        with pytest.raises(TransferError) as failed:  # lost mid-send, or refused once the loss is known
            await sender.send(channel, receiver.next_tag(channel), torch.randn(SHAPE))
        assert failed.value.reason in (TransferFailure.PEER_LOST, TransferFailure.CLOSED)
        with pytest.raises(TransferError) as closed:
            await sender.send(channel, receiver.next_tag(channel), torch.randn(SHAPE))
        assert closed.value.reason is TransferFailure.CLOSED
        receiver.drop(channel)  # as the decode side does after the failed handoff
        data = torch.randn(SHAPE)
        _, buffer, _, _ = await _move(receiver, sender, data)
        return buffer, data

    buffer, data = asyncio.run(main())
    assert torch.equal(buffer, data)


def test_a_cancelled_send_ends_without_filling_more_and_the_agent_serves_on(pair):
    receiver, sender = pair
    filled: list[slice] = []
    staging = torch.zeros(SHAPE)

    async def main():
        channel = receiver.channel_for("prefill-c")  # nothing receives: the send waits in gloo
        send = asyncio.ensure_future(sender.send(channel, receiver.next_tag(channel), staging, filled.append))
        while not filled:
            await asyncio.sleep(0.01)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        count = len(filled)
        receiver.drop(channel)
        data = torch.randn(SHAPE)
        _, buffer, _, _ = await _move(receiver, sender, data, "prefill-d")
        return count, buffer, data

    count, buffer, data = asyncio.run(main())
    assert count == len(filled)  # nothing was filled after the cancel
    assert torch.equal(buffer, data)


def test_segments_are_kept_for_the_next_transfer_of_their_size_but_not_after_a_cancel(pair):
    """A fresh segment's pages are zero-filled on both sides; a kept one is not. A cancelled receive's
    agent may still write its segment, so that one is never handed out again."""
    receiver, sender = pair
    segments = isolated._SEGMENTS

    async def main():
        await _move(receiver, sender, torch.randn(SHAPE), "prefill-e")
        kept = {id(s) for idle in segments._idle.values() for s in idle}
        channel = receiver.channel_for("prefill-f")  # nothing sends: the receive waits in the agent
        waiting = asyncio.ensure_future(receiver.recv(channel, receiver.next_tag(channel), torch.empty(SHAPE)))
        await asyncio.sleep(0)  # the receive takes its segment before it first waits
        taken = kept - {id(s) for idle in segments._idle.values() for s in idle}
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return taken, {id(s) for idle in segments._idle.values() for s in idle}

    taken, after = asyncio.run(main())
    assert taken, "the receive made a new segment with one of its size idle"
    assert not taken & after, "a cancelled receive's segment went back to the pool"
