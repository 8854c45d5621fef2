"""One transfer on the wire: its tensor in chunks of whole rows, each sent as soon as it is ready and
checksummed while the next one moves.

A KV piece [num_layers, 2, n, block_size, heads, head_dim] is viewed as rows [num_layers * 2, -1]
(one row per layer and K/V, holding all n blocks): a range of rows is contiguous in the piece, and
it is also what gather_blocks can read from the cache on its own, so the sender gathers chunk i+1
while chunk i is on the wire, and the receiver hashes chunk i while chunk i+1 arrives. Both sides
derive the same plan from the shape and dtype, which they share by contract.

Every chunk is one gloo send/recv under its own tag (wire_tag: the transfer's tag and the chunk's
index), so chunks never match across transfers whatever the order the two sides post them in.
A whole transfer runs on one worker thread per side (one thread hop, not one per step).

CUDA tensors over gloo go through pinned host memory, chunk by chunk, with the device<->host copies
issued on a side stream so that the copy of one chunk overlaps the wire time of another.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from splitserve.services.disagg.transfer.base import Drain, Fill
from splitserve.services.disagg.transfer.checksum import RunningChecksum
from splitserve.services.engine.cpu_threads import serial_torch_ops

CHUNK_BYTES = 4 << 20  # big enough that a gloo op's fixed cost is noise, small enough to pipeline
CHUNK_BITS = 8  # chunks per transfer: at most 2**CHUNK_BITS
TAG_SPACE = (1 << (31 - CHUNK_BITS)) - 1  # gloo tags are int32: transfer tags wrap within this
# One per send in flight; they copy serially (services/engine/cpu_threads.py: no OpenMP pool beside the step thread's).
_HELPERS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-chunks", initializer=serial_torch_ops)


def row_view(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, -1]: one row per leading index pair (layer and K/V of a KV piece)."""
    num_rows = tensor.shape[0] * tensor.shape[1] if tensor.dim() >= 2 else 1
    return tensor.view(num_rows, -1)


def plan(tensor: torch.Tensor) -> list[slice]:
    """The chunks of a transfer, as ranges of rows (at least one, even for an empty tensor)."""
    num_rows = row_view(tensor).shape[0]
    row_bytes = tensor.numel() * tensor.element_size() // max(num_rows, 1)
    per_chunk = max(-(-num_rows >> CHUNK_BITS), CHUNK_BYTES // max(row_bytes, 1), 1)
    return [slice(start, min(start + per_chunk, num_rows)) for start in range(0, max(num_rows, 1), per_chunk)]


def wire_tag(tag: int, index: int) -> int:
    """The gloo tag of chunk index of transfer tag (>= 1): never 0, the handshake's."""
    return (((tag - 1) % TAG_SPACE) + 1) << CHUNK_BITS | index


def send_chunks(group: dist.ProcessGroup, peer: int, tag: int, blocks: torch.Tensor, fill: Fill | None) -> int:
    """Blocking (a worker thread): send every chunk as soon as it is filled, wait for all; returns
    the checksum of what was sent. A helper thread fills and hashes the chunks in order, because
    gloo often writes a chunk into the socket in the thread that posts it: the gather of chunk i+1
    then overlaps the write of chunk i instead of following it."""
    if blocks.is_cuda:
        return _send_from_device(group, peer, tag, blocks, fill)
    rows, chunks = row_view(blocks), plan(blocks)
    ready: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
    prepared = _HELPERS.submit(_prepare, rows, chunks, fill, ready)
    works = []
    for index, chunk in enumerate(chunks):
        if fill is not None and (failed := ready.get()) is not None:
            raise failed
        works.append(group.send([rows[chunk]], peer, wire_tag(tag, index)))
    for work in works:
        work.wait()
    return prepared.result()


def _prepare(rows: torch.Tensor, chunks: list[slice], fill: Fill | None, ready: queue.SimpleQueue) -> int:
    """Fill each chunk (then it may go: None into ready) and hash it, in order; gloo only reads it."""
    running = RunningChecksum()
    for chunk in chunks:
        if fill is not None:
            try:
                fill(chunk)
            except BaseException as e:
                ready.put(e)
                raise
            ready.put(None)
        running.update(rows[chunk])
    return running.value


def recv_chunks(group: dist.ProcessGroup, peer: int, tag: int, buffer: torch.Tensor, drain: Drain | None) -> int:
    """Blocking (a worker thread): post every chunk's receive, hash each as it lands and hand it to
    drain (when given) while the next arrives; returns the checksum of what arrived."""
    if buffer.is_cuda:
        return _recv_to_device(group, peer, tag, buffer, drain)
    rows, running = row_view(buffer), RunningChecksum()
    chunks = plan(buffer)
    works = [group.recv([rows[chunk]], peer, wire_tag(tag, i)) for i, chunk in enumerate(chunks)]
    for work, chunk in zip(works, chunks):
        work.wait()
        running.update(rows[chunk])
        if drain is not None:
            drain(chunk)
    return running.value


def _send_from_device(group: dist.ProcessGroup, peer: int, tag: int, blocks: torch.Tensor, fill: Fill | None) -> int:
    """A CUDA tensor over gloo: fill and copy every chunk to pinned host memory on a side stream
    (queued at once), then send each as soon as its copy is done."""
    host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=True)
    rows, host_rows, side = row_view(blocks), row_view(host), torch.cuda.Stream(blocks.device)
    side.wait_stream(torch.cuda.current_stream(blocks.device))  # whatever wrote the cache so far
    copied = []
    with torch.cuda.stream(side):
        for chunk in plan(blocks):
            if fill is not None:
                fill(chunk)
            host_rows[chunk].copy_(rows[chunk], non_blocking=True)
            copied.append(side.record_event())
    running, works = RunningChecksum(), []
    for index, (chunk, event) in enumerate(zip(plan(blocks), copied)):
        event.synchronize()
        works.append(group.send([host_rows[chunk]], peer, wire_tag(tag, index)))
        running.update(host_rows[chunk])
    for work in works:
        work.wait()
    return running.value


def _recv_to_device(group: dist.ProcessGroup, peer: int, tag: int, buffer: torch.Tensor, drain: Drain | None) -> int:
    """A CUDA buffer over gloo: receive into pinned host memory; each chunk, once landed and hashed,
    goes up (and to drain) on a side stream while the next arrives; returns once all are done."""
    host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
    rows, host_rows, side = row_view(buffer), row_view(host), torch.cuda.Stream(buffer.device)
    chunks, running = plan(buffer), RunningChecksum()
    works = [group.recv([host_rows[chunk]], peer, wire_tag(tag, i)) for i, chunk in enumerate(chunks)]
    with torch.cuda.stream(side):
        for work, chunk in zip(works, chunks):
            work.wait()
            running.update(host_rows[chunk])
            rows[chunk].copy_(host_rows[chunk], non_blocking=True)
            if drain is not None:
                drain(chunk)
    side.synchronize()
    return running.value
