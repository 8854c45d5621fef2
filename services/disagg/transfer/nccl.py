"""NCCL pair groups: KV moves device to device, with no host staging. UNTESTED ON A GPU: no GPU has
run this file yet (tests/unit/disagg/test_transfer_gpu.py runs it where two CUDA devices are present).

A channel whose receiver keeps its KV on CUDA (Backend.NCCL, backend_for) is a gloo pair group, as
on CPU, which carries the HMAC handshake (torch_dist.py), plus a two-rank ProcessGroupNCCL built in
the same rendezvous: its communicator is connected eagerly, before the proofs, so the NCCL unique id
both ranks read from the store is part of the rendezvous the proofs bind (a process that rewrote it
fails the handshake). No NCCL operation is issued on a channel before the handshake has passed.

Transfers: NCCL point-to-point ignores tags, so both sides issue a channel's transfers in the
receiver's tag order (order.py). Every operation is issued as a coalesced batch of one, which uses
the communicator built at connect time (a plain send would lazily build another one, outside the
handshake). Each side issues on a side stream that first waits for whatever wrote its tensor, then
waits on the host, bounded by the timeout: past it the group is aborted (which ends the pending
kernels) and the transfer fails with "timeout". NCCL's own watchdog gets a longer timeout than ours,
so that it never takes the process down for a transfer we already gave up on.

Checksums: device_checksum on each side (one read of the bytes on the device; nothing comes to the
host but the sum).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from splitserve.services.disagg.transfer.base import Backend, Drain, Fill, TransferError, TransferFailure
from splitserve.services.disagg.transfer.checksum import device_checksum
from splitserve.services.disagg.transfer.chunks import row_view
from splitserve.services.disagg.transfer.order import IssueOrder, OrderTimeout

WATCHDOG_FACTOR = 4  # NCCL's own timeout, in multiples of ours
POLL_S = 0.0005


def backend_for(device: torch.device) -> Backend:
    """The receiver's choice of wire for KV on device: NCCL for CUDA when this torch has it."""
    return Backend.NCCL if device.type == "cuda" and dist.is_nccl_available() else Backend.GLOO


def make_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """The pair's NCCL group on device, its communicator connected now, through store."""
    nccl = dist.ProcessGroupNCCL  # torch's stubs have it; a CPU build of torch does not (never called there)
    options = nccl.Options()
    options._timeout = timedelta(seconds=timeout_s * WATCHDOG_FACTOR)
    group = nccl(dist.PrefixStore("nccl", store), rank, 2, options)
    group.eager_connect_single_device(device)
    return cast(dist.ProcessGroup, group)


def send(
    group: dist.ProcessGroup,
    order: IssueOrder,
    peer: int,
    tag: int,
    blocks: torch.Tensor,
    fill: Fill | None,
    device: torch.device,
    timeout_s: float,
) -> int:
    """Blocking (a worker thread): fill blocks, send them from device in the channel's order; the
    device checksum of what was sent."""
    if not blocks.is_cuda:  # a host piece on an NCCL channel: filled here, then copied up
        if fill is not None:
            fill(slice(0, row_view(blocks).shape[0]))
        blocks, fill = blocks.to(device), None
    side = _side_stream(blocks.device)
    with torch.cuda.stream(side):
        if fill is not None:
            fill(slice(0, row_view(blocks).shape[0]))
        crc = device_checksum(blocks)
        _issue(group, order, tag, blocks.device, lambda: group.send([blocks], peer, 0), timeout_s)
    _until_done(group, side, timeout_s, f"sending transfer {tag}")
    return crc


def recv(
    group: dist.ProcessGroup,
    order: IssueOrder,
    peer: int,
    tag: int,
    buffer: torch.Tensor,
    device: torch.device,
    timeout_s: float,
    drain: Drain | None = None,
) -> int:
    """Blocking (a worker thread): receive into buffer (a host buffer lands in a device copy first)
    in the channel's order; the device checksum of what arrived. One piece moves in one op, so
    drain gets every row at once, at the end."""
    landing = buffer if buffer.is_cuda else torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
    side = _side_stream(landing.device)
    with torch.cuda.stream(side):
        _issue(group, order, tag, landing.device, lambda: group.recv([landing], peer, 0), timeout_s)
    _until_done(group, side, timeout_s, f"receiving transfer {tag}")
    with torch.cuda.stream(side):
        crc = device_checksum(landing)
    if landing is not buffer:
        buffer.copy_(landing)
    if drain is not None:
        with torch.cuda.stream(side):
            drain(slice(0, row_view(buffer).shape[0]))
        side.synchronize()
    return crc


def _issue(group, order: IssueOrder, tag: int, device: torch.device, op, timeout_s: float) -> None:
    try:
        order.wait_turn(tag, timeout_s)
    except OrderTimeout as e:
        raise TransferError(TransferFailure.TIMEOUT, str(e)) from None
    try:
        group._start_coalescing(device)  # a batch of one: the communicator the handshake bound
        op()
        group._end_coalescing(device).wait()  # the side stream waits for it; the host does not
    finally:
        order.issued(tag)


def _until_done(group, side: torch.cuda.Stream, timeout_s: float, what: str) -> None:
    done, deadline = side.record_event(), time.monotonic() + timeout_s
    while not done.query():
        if time.monotonic() > deadline:
            group.abort()  # ends the pending kernels; the channel is dropped by the caller
            raise TransferError(TransferFailure.TIMEOUT, f"{what} did not finish within {timeout_s} s")
        time.sleep(POLL_S)


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))  # whatever wrote the tensor so far
    return side
