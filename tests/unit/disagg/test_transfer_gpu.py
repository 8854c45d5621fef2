"""The transport with CUDA tensors: a gloo channel stages them through pinned host memory (one GPU),
an NCCL channel moves them device to device in the receiver's tag order (two GPUs: NCCL puts no two
ranks of a communicator on one device). Skipped without them; until a GPU machine has run this file
the CUDA paths are untested (docs/disaggregation.md says so)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.distributed as dist

from splitserve.services.disagg.transfer.base import Backend
from splitserve.services.disagg.transfer.checksum import checksum, device_checksum
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.services.engine.kv_cache.block_io import gather_blocks

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHAPE = (4, 2, 6, 16, 2, 64)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


@pytest.mark.skipif(NUM_GPUS < 1, reason="needs a CUDA device")
def test_a_gloo_channel_moves_cuda_tensors_through_pinned_memory():
    cuda = torch.device("cuda", 0)
    cache, ids = torch.randn(4, 2, 20, 16, 2, 64, device=cuda), [19, 3, 7, 0, 11, 5]
    want = gather_blocks(cache, ids)

    async def main():
        receiver = TorchDistReceiver(timeout_s=30)  # no use_device: a gloo channel whatever the tensors
        sender = TorchDistSender(timeout_s=30)
        channel = receiver.channel_for("prefill-a")
        assert channel.backend is Backend.GLOO
        staging, buffer = torch.empty_like(want), torch.empty_like(want)
        tag = receiver.next_tag(channel)
        fill = lambda rows: gather_blocks(cache, ids, staging, rows)  # noqa: E731  # on the device, chunk by chunk
        got, put = await asyncio.gather(receiver.recv(channel, tag, buffer), sender.send(channel, tag, staging, fill))
        receiver.close(), sender.close()
        return buffer, got, put

    buffer, got, put = asyncio.run(main())
    assert buffer.device == cuda and torch.equal(buffer, want)
    assert got.checksum == put.checksum == checksum(want)


@pytest.mark.skipif(NUM_GPUS < 2 or not dist.is_nccl_available(), reason="needs NCCL and two CUDA devices")
def test_an_nccl_channel_moves_device_tensors_in_the_receivers_order():
    receive_on, send_on = torch.device("cuda", 0), torch.device("cuda", 1)
    sent = {tag: torch.randn(SHAPE, device=send_on) for tag in (1, 2, 3, 4)}

    async def main():
        receiver = TorchDistReceiver(timeout_s=60, device=receive_on)
        sender = TorchDistSender(timeout_s=60, device=send_on)
        channel = receiver.channel_for("prefill-a")
        assert channel.backend is Backend.NCCL
        tags = [receiver.next_tag(channel) for _ in sent]
        assert tags == list(sent)
        buffers = {tag: torch.empty(SHAPE, device=receive_on) for tag in tags}
        # Posted out of order on both sides: the channel's order (the tags) decides what meets what.
        recvs = [receiver.recv(channel, tag, buffers[tag]) for tag in (3, 1, 4, 2)]
        sends = [sender.send(channel, tag, sent[tag]) for tag in (4, 2, 1, 3)]
        moved = await asyncio.gather(*recvs, *sends)
        receiver.close(), sender.close()
        return buffers, moved

    buffers, moved = asyncio.run(main())
    for tag, tensor in sent.items():
        assert torch.equal(buffers[tag].cpu(), tensor.cpu())
    by_tag = dict(zip((3, 1, 4, 2), moved[:4]))
    for tag, put in zip((4, 2, 1, 3), moved[4:]):
        assert by_tag[tag].checksum == put.checksum == device_checksum(sent[tag])
