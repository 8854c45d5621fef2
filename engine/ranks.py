"""Tensor parallelism inside one worker: rank 0 (the worker process: it serves, schedules and samples)
and N - 1 follower rank processes holding the other shards of the model and of the KV cache, which
run every forward beside it, as vLLM's multiprocess executor does.

Lifecycle of a follower:  spawned -> joined (groups built) -> loaded -> following -> gone

Three channels between rank 0 and each follower:
- a pipe (raw bytes; nothing is pickled after the spawn): rank 0's orders, in the order it gives
  them: STEP (one step's integer inputs, StepArrays), WARM_UP, READ_KV / WRITE_KV (the blocks of a
  KV handoff), STOP. A follower blocks on its pipe for as long as the worker is idle (a collective
  would time out).
- the compute group (gloo on CPU, NCCL on CUDA): the model's all-reduces and all-gathers.
- the KV group (gloo, host memory): the shards of handed-off blocks, gathered to rank 0 or scattered
  from it. Handoffs run beside steps (on other threads of rank 0), hence a group of their own;
  rank 0 gives a KV order and runs its collective under one lock, so the KV group sees its
  collectives in the order the followers read the orders.

Failure: a rank that is gone, or a collective that failed, leaves the ranks out of step for good.
Rank 0 raises RanksLost from the step (the engine loop dies: streams end UNAVAILABLE, health goes
NOT_SERVING, the worker deregisters and exits); a monitor thread reports a follower that exits
while the worker is idle (on_lost); a follower exits when rank 0's pipe closes or a collective fails.
"""

from __future__ import annotations

import enum
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist

from splitserve.common.dist_store import gloo_device, host_store
from splitserve.engine.config import EngineConfig
from splitserve.engine.step_inputs import StepArrays
from splitserve.model.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:
    from splitserve.engine.model_runner import ModelRunner

log = logging.getLogger("splitserve.engine")
HOST = "127.0.0.1"  # the ranks of a worker share its machine; nothing else may join their store
GROUP_TIMEOUT_S = 300.0  # a collective waits this long for a rank that is alive but stuck
START_TIMEOUT_S = 600.0  # followers load the model before the first collective of the runner


class RanksLost(RuntimeError):
    """A rank of this worker is gone or a collective failed: the ranks are out of step for good."""


class Op(enum.IntEnum):
    STEP = 1
    WARM_UP = 2
    READ_KV = 3
    WRITE_KV = 4
    STOP = 5


@dataclass(frozen=True, slots=True)
class RankGroups:
    """What a rank's ModelRunner needs: its place in the compute group and the KV group."""

    tp: TensorParallel = SINGLE
    kv: dist.ProcessGroup | None = None  # gloo, for handoff shards (None when tp.size == 1)

    @property
    def kv_group(self) -> dist.ProcessGroup:
        if self.kv is None:
            raise RuntimeError("a single rank has no KV group")
        return self.kv


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a worker on cuda:i runs on cuda:i+r (give the worker its N GPUs); CPU ranks share the CPU."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def kv_heads_of(tp: TensorParallel, num_kv_heads: int, rank: int) -> range:
    """The KV heads rank holds in tp's group."""
    return TensorParallel(rank, tp.size).kv_head_range(num_kv_heads)


def make_groups(store: dist.Store, rank: int, size: int, device: torch.device) -> RankGroups:
    compute_store = dist.PrefixStore("compute", store)
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL(compute_store, rank, size, dist.ProcessGroupNCCL.Options())
        compute = cast(dist.ProcessGroup, nccl)
    else:
        compute = _gloo(compute_store, rank, size)
    kv = _gloo(dist.PrefixStore("kv", store), rank, size)
    return RankGroups(TensorParallel(rank, size, compute), kv)


def _gloo(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    # torch's stubs lag its bindings (no _Options on ProcessGroupGloo): hence the ignore and the cast.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [gloo_device(HOST)]
    options._timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    return cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, size, options))


# -- the orders on the pipe: int64 header [op, num_arrays, (ndim, *shape) per array], then the arrays --
def encode(op: Op, *arrays: np.ndarray) -> bytes:
    header = [int(op), len(arrays)]
    for a in arrays:
        header += [a.ndim, *a.shape]
    parts = [np.array([len(header), *header], dtype=np.int64)]
    parts += [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    return b"".join(p.tobytes() for p in parts)


def decode(data: bytes) -> tuple[Op, list[np.ndarray]]:
    flat = np.frombuffer(data, dtype=np.int64).copy()  # writable: the arrays are packed in place
    header_len = int(flat[0])
    header, pos = flat[1 : 1 + header_len], 2
    offset, arrays = 1 + header_len, []
    for _ in range(int(header[1])):
        ndim = int(header[pos])
        shape = tuple(int(d) for d in header[pos + 1 : pos + 1 + ndim])
        pos += 1 + ndim
        size = int(np.prod(shape, dtype=np.int64))
        arrays.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return Op(int(header[0])), arrays


def step_arrays_to_wire(a: StepArrays) -> tuple[np.ndarray, ...]:
    return (a.input_ids, a.starts, a.query_lens, a.block_table, a.samples.astype(np.int64))


def step_arrays_from_wire(arrays: Sequence[np.ndarray]) -> StepArrays:
    input_ids, starts, query_lens, block_table, samples = arrays
    return StepArrays(input_ids, starts, query_lens, block_table, samples.astype(bool))


class Followers:
    """Rank 0's side: the follower processes, their pipes, and rank 0's groups."""

    def __init__(self, procs: list, pipes: list[Connection], groups: RankGroups, store: dist.Store) -> None:
        self._procs, self._pipes, self.groups = procs, pipes, groups
        self._store = store  # the ranks' rendezvous, kept for as long as they live
        self._pipe_lock = threading.Lock()  # one order at a time on the pipes
        self._kv_lock = threading.Lock()  # a KV order and its collective, together
        self._closing = threading.Event()
        self.on_lost: Callable[[RanksLost], None] | None = None
        self._lost: RanksLost | None = None
        threading.Thread(target=self._watch, name="tp-ranks-watch", daemon=True).start()

    @classmethod
    def start(cls, config: EngineConfig, max_model_len: int, device: torch.device) -> Followers:
        """Spawn ranks 1..N-1 (each loads its shard) and build rank 0's groups with them."""
        size = config.tensor_parallel_size
        store = host_store(HOST, START_TIMEOUT_S)
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            args = (config, max_model_len, rank, store.port, theirs, torch.get_num_threads())
            proc = ctx.Process(target=follow, args=args, name=f"tp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            pipes.append(ours)
        try:
            groups = make_groups(store, 0, size, device)
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
        log.info("tensor parallel: %d ranks (followers: pids %s)", size, [p.pid for p in procs])
        return cls(procs, pipes, groups, store)

    # -- orders ---------------------------------------------------------------------------------
    def step(self, arrays: StepArrays) -> None:
        self._send(encode(Op.STEP, *step_arrays_to_wire(arrays)))

    def warm_up(self, full: bool) -> None:
        self._send(encode(Op.WARM_UP, np.array([int(full)])))

    def read_kv(self, block_ids: Sequence[int], local: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's shard of these blocks (rank 0's is local, [L, 2, n, bs, local kvh, d] on the host)."""
        with self._kv_lock:
            self._send(encode(Op.READ_KV, np.asarray(block_ids, dtype=np.int64)))
            shards = [torch.empty_like(local) for _ in range(len(self._procs) + 1)]
            self._wait(self.groups.kv_group.gather(shards, local, 0))
        return shards

    def write_kv(self, block_ids: Sequence[int], shards: list[torch.Tensor]) -> torch.Tensor:
        """Hand rank r shards[r] for these blocks; returns rank 0's own (shards[0])."""
        with self._kv_lock:
            self._send(encode(Op.WRITE_KV, np.asarray(block_ids, dtype=np.int64)))
            mine = torch.empty_like(shards[0])
            self._wait(self.groups.kv_group.scatter(mine, shards, 0))
        return mine

    def _send(self, data: bytes) -> None:
        if self._lost is not None:
            raise self._lost
        try:
            with self._pipe_lock:
                for pipe in self._pipes:
                    pipe.send_bytes(data)
        except OSError as e:
            raise RanksLost(f"a tensor-parallel rank is gone ({e})") from e

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as e:  # gloo reports a lost peer and a timeout alike (RuntimeError)
            raise RanksLost(f"a tensor-parallel collective failed: {e}") from e

    # -- life -----------------------------------------------------------------------------------
    def _watch(self) -> None:
        """Report the first follower that exits while this worker still runs."""
        sentinels = {proc.sentinel: proc for proc in self._procs}
        ready = wait(list(sentinels))
        if self._closing.is_set():
            return
        proc = sentinels[cast(int, ready[0])]
        proc.join(1.0)
        self._lost = RanksLost(f"tensor-parallel rank {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}")
        log.error("%s; this worker cannot step any more", self._lost)
        if self.on_lost is not None:
            self.on_lost(self._lost)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the followers (they exit at STOP, or when the pipe closes)."""
        if self._closing.is_set():
            return
        self._closing.set()
        for pipe in self._pipes:
            try:
                pipe.send_bytes(encode(Op.STOP))
            except OSError:
                pass
            pipe.close()
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()


def follow(config: EngineConfig, max_model_len: int, rank: int, port: int, pipe: Connection, threads: int) -> None:
    """A follower rank's process: join the groups, load the shard, then carry out rank 0's orders."""
    from splitserve.engine.model_runner import ModelRunner, resolve_device
    from splitserve.model.loader import open_model

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    device = rank_device(resolve_device(config.device), rank)
    groups = make_groups(store, rank, config.tensor_parallel_size, device)
    runner = ModelRunner(config, open_model(config.model), max_model_len, groups)
    while True:
        try:
            op, arrays = decode(pipe.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if op is Op.STOP:
            return
        _carry_out(runner, groups, op, arrays)


def _carry_out(runner: ModelRunner, groups: RankGroups, op: Op, arrays: list[np.ndarray]) -> None:
    kv = groups.kv_group
    if op is Op.STEP:
        runner.follow_step(step_arrays_from_wire(arrays))
    elif op is Op.WARM_UP:
        runner.warm_up(bool(arrays[0][0]))
    elif op is Op.READ_KV:
        kv.gather([], runner.read_local_blocks(arrays[0].tolist()), 0).wait()
    elif op is Op.WRITE_KV:
        shard = runner.empty_local_blocks(len(arrays[0]))
        kv.scatter(shard, [], 0).wait()
        runner.write_local_blocks(arrays[0].tolist(), shard)
