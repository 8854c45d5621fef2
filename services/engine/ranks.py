"""Tensor parallelism inside one worker: rank 0 (the worker process: it serves, schedules and samples)
and N - 1 follower rank processes holding the other shards of the model and of the KV cache, which
run every forward beside it, as vLLM's multiprocess executor does.

Lifecycle of a follower:  spawned -> joined (groups built) -> loaded -> following -> gone

Channels between rank 0 and each follower:
- a duplex pipe (raw bytes; nothing is pickled after the spawn). Rank 0 -> follower: orders, in the
  order it gives them. The follower's step loop reads them all; it carries out STEP, WARM_UP and
  COMMIT_KV itself (so a received KV piece enters the cache between the steps rank 0 ordered around
  it) and hands the KV transfer orders (OPEN_KV, KV_CHANNEL, RECV_KV, SEND_KV, DISCARD_KV, DROP_KV)
  to its transfer agent (services/disagg/rank_transfers.py: its own transport endpoint, run by a thread of its
  own, so a transfer never blocks a step; CONNECT_KV too; STREAM_KV with the progress of the STEP
  that follows it, whose layers its send waits on). Follower -> rank 0: replies (order number, status,
  payload), written by the agent's thread only; rank 0 reads them on one thread, which resolves the
  futures ask() returned. A follower blocks on its pipe for as long as the worker is idle (a
  collective would time out).
- the compute group (gloo on CPU, NCCL on CUDA): the model's all-reduces and all-gathers.
- the host group (gloo): agreeing on the number of KV blocks at start.

KV handoffs between workers go rank to rank (services/disagg/plan.py): each rank sends or receives the KV
heads it holds on its own transport endpoint; nothing is gathered through rank 0.

Failure: a rank that is gone, or a collective that failed, leaves the ranks out of step for good.
Rank 0 raises RanksLost from the step (the engine loop dies: streams end UNAVAILABLE, health goes
NOT_SERVING, the worker deregisters and exits); its reader thread reports a follower that exits
while the worker is idle (on_lost) and fails every order still waiting for that rank's reply; a
follower exits when rank 0's pipe closes or a collective fails.
"""

from __future__ import annotations

import atexit
import enum
import itertools
import logging
import multiprocessing as mp
import os
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

import numpy as np
import torch
import torch.distributed as dist

from splitserve.common.dist_store import gloo_device, host_store
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.layer_progress import LayerProgress
from splitserve.services.engine.step_inputs import StepArrays
from splitserve.services.model.parallel import SINGLE, TensorParallel

if TYPE_CHECKING:
    from splitserve.services.engine.model_runner import ModelRunner

log = logging.getLogger("splitserve.services.engine")
HOST = "127.0.0.1"  # the ranks of a worker share its machine; nothing else may join their store
GROUP_TIMEOUT_S = 300.0  # a collective waits this long for a rank that is alive but stuck
START_TIMEOUT_S = 600.0  # followers load the model before the first collective of the runner
# A follower's exit code when its spawn re-ran a script whose top level starts ranks (see MainNotGuarded).
MAIN_NOT_GUARDED_EXIT = 79


class RanksLost(RuntimeError):
    """A rank of this worker is gone or a collective failed: the ranks are out of step for good."""


class MainNotGuarded(RanksLost):
    """The followers could not start: spawning them re-runs the script's top level, which starts ranks."""


class Op(enum.IntEnum):
    """Rank 0's orders."""

    STEP = 1  # one step's integer inputs (StepArrays)
    WARM_UP = 2  # [full]
    OPEN_KV = 3  # make this rank's KV transport endpoint (receiver or sender), on the worker's host
    KV_CHANNEL = 4  # decode: this rank's channel to a prefill rank (reply: the ChannelSpec)
    RECV_KV = 5  # decode: receive one piece into a buffer (reply: its bytes and checksum)
    SEND_KV = 6  # prefill: send this rank's heads of held blocks (reply: bytes, checksum)
    COMMIT_KV = 7  # decode: write a received piece into the cache (on the step loop; no reply)
    DISCARD_KV = 8  # decode: forget a received piece, or one still arriving (no reply)
    DROP_KV = 9  # decode: forget a failed channel (no reply)
    CONNECT_KV = 10  # prefill: start joining a channel while the prompt computes (no reply)
    STOP = 11
    # prefill: SEND_KV of blocks the next STEP computes, each layer sent once that step has written
    # it (sent just before that STEP; reply: bytes, checksum)
    STREAM_KV = 12


class Status(enum.IntEnum):
    """A follower's reply to an order."""

    OK = 1
    FAILED = 2  # the payload says why (the transfer agent's encoding)


@dataclass(frozen=True, slots=True)
class RankGroups:
    """What a rank's ModelRunner needs: its place in the compute group and the host group."""

    tp: TensorParallel = SINGLE
    host: dist.ProcessGroup | None = None  # gloo, for agreements on the host (None when tp.size == 1)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r of a worker on cuda:i runs on cuda:i+r (give the worker its N GPUs); CPU ranks share the CPU."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def make_groups(store: dist.Store, rank: int, size: int, device: torch.device) -> RankGroups:
    compute_store = dist.PrefixStore("compute", store)
    if device.type == "cuda":
        nccl = dist.ProcessGroupNCCL(compute_store, rank, size, dist.ProcessGroupNCCL.Options())
        compute = cast(dist.ProcessGroup, nccl)
    else:
        compute = _gloo(compute_store, rank, size)
    host = _gloo(dist.PrefixStore("host", store), rank, size)
    return RankGroups(TensorParallel(rank, size, compute), host)


def _gloo(store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    # torch's stubs lag its bindings (no _Options on ProcessGroupGloo): hence the ignore and the cast.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [gloo_device(HOST)]
    options._timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    return cast(dist.ProcessGroup, dist.ProcessGroupGloo(store, rank, size, options))


# -- messages on the pipe: an int64 header [kind, number, num_arrays, (dtype, ndim, *shape) per array],
# -- then each array's bytes, padded to 8. Orders and replies alike; arrays are int64 or uint8 (bytes).
_DTYPES: dict[int, np.dtype] = {1: np.dtype(np.int64), 2: np.dtype(np.uint8)}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


class Message(NamedTuple):
    kind: int  # an Op (an order) or a Status (a reply)
    number: int  # an order's number, repeated by its reply; 0: an order that wants none
    arrays: list[np.ndarray]


def encode(kind: int, *arrays: np.ndarray, number: int = 0) -> bytes:
    """Arrays of uint8 travel as bytes; every other array as int64."""
    header, body = [int(kind), number, len(arrays)], []
    for a in arrays:
        a = np.ascontiguousarray(a if a.dtype == np.uint8 else a.astype(np.int64))
        header += [_CODES[a.dtype], a.ndim, *a.shape]
        raw = a.tobytes()
        body.append(raw + bytes(-len(raw) % 8))
    return np.array([len(header), *header], dtype=np.int64).tobytes() + b"".join(body)


def decode(data: bytes) -> Message:
    header_len = int(np.frombuffer(data, dtype=np.int64, count=1)[0])
    header = [int(x) for x in np.frombuffer(data, dtype=np.int64, count=header_len, offset=8)]
    offset, pos, arrays = 8 * (1 + header_len), 3, []
    for _ in range(header[2]):
        dtype, ndim = _DTYPES[header[pos]], header[pos + 1]
        shape = tuple(header[pos + 2 : pos + 2 + ndim])
        pos += 2 + ndim
        count = int(np.prod(shape, dtype=np.int64))
        arrays.append(np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape).copy())
        offset += -(-count * dtype.itemsize // 8) * 8
    return Message(header[0], header[1], arrays)


def bytes_array(data: bytes) -> np.ndarray:
    """Bytes (a string encoded, a secret) as an array a message carries."""
    return np.frombuffer(data, dtype=np.uint8)


def step_arrays_to_wire(a: StepArrays) -> tuple[np.ndarray, ...]:
    assert a.decode_seq_ids is not None, "followers step scheduled batches only"
    return (a.input_ids, a.starts, a.query_lens, a.block_table, a.samples.astype(np.int64), a.decode_seq_ids)


def step_arrays_from_wire(arrays: Sequence[np.ndarray]) -> StepArrays:
    input_ids, starts, query_lens, block_table, samples, decode_seq_ids = arrays
    return StepArrays(input_ids, starts, query_lens, block_table, samples.astype(bool), decode_seq_ids)


def commit_to_wire(tag: int, block_ids: Sequence[int], heads: range) -> tuple[np.ndarray, ...]:
    """COMMIT_KV's payload: the piece received under tag goes to these KV heads (global) of these blocks."""
    return np.array([tag, heads.start, heads.stop]), np.asarray(block_ids, dtype=np.int64)


def commit_from_wire(arrays: Sequence[np.ndarray]) -> tuple[int, list[int], range]:
    (tag, first, stop), block_ids = (int(x) for x in arrays[0]), arrays[1]
    return tag, block_ids.tolist(), range(first, stop)


class TransferAgent(Protocol):
    """A follower's KV transfers (services/disagg/rank_transfers.py), as its step loop sees them."""

    def submit(self, order: Message, layers: LayerProgress | None = None) -> None:
        """Start a transfer order on the agent's own thread; its reply goes to rank 0 from there.
        layers: STREAM_KV's, the progress of the step that computes the blocks it sends."""

    def commit(self, tag: int, write: Callable[[torch.Tensor], None]) -> None:
        """COMMIT_KV, on the step loop: write(piece) for the piece received under tag, then forget it."""

    def close(self) -> None: ...


class Followers:
    """Rank 0's side: the follower processes, their pipes, and rank 0's groups."""

    def __init__(self, procs: list, pipes: list[Connection], groups: RankGroups, store: dist.Store) -> None:
        self._procs, self._pipes, self.groups = procs, pipes, groups
        self._store = store  # the ranks' rendezvous, kept for as long as they live
        self._lock = threading.Lock()  # the pipes' write side, the pending orders and _lost
        self._pending: dict[int, Future[Message]] = {}  # orders waiting for their reply, by number
        self._numbers = itertools.count(1)
        self._closing = threading.Event()
        self.on_lost: Callable[[RanksLost], None] | None = None
        self._lost: RanksLost | None = None
        self._reader = threading.Thread(target=self._read, name="tp-ranks-replies", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, config: EngineConfig, max_model_len: int, device: torch.device) -> Followers:
        """Spawn ranks 1..N-1 (each loads its shard) and build rank 0's groups with them."""
        if _importing_main_to_spawn():
            # We are a follower being spawned, and the script we re-ran starts ranks at its top level:
            # multiprocessing would refuse with a RuntimeError; our exit code lets rank 0 say what to do.
            raise SystemExit(MAIN_NOT_GUARDED_EXIT)
        size = config.tensor_parallel_size
        store = host_store(HOST, START_TIMEOUT_S)
        ctx = mp.get_context("spawn")
        procs, pipes = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe(duplex=True)
            args = (config, max_model_len, rank, store.port, theirs, torch.get_num_threads())
            proc = ctx.Process(target=follow, args=args, name=f"tp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            pipes.append(ours)
        try:
            groups = _join_watching(procs, lambda: make_groups(store, 0, size, device))
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
        log.info("tensor parallel: %d ranks (followers: pids %s)", size, [p.pid for p in procs])
        followers = cls(procs, pipes, groups, store)
        # Before multiprocessing's own exit handler (registered earlier: they run last first) ends the
        # daemonic followers, which the reader thread would report as lost ranks.
        atexit.register(followers.close)
        return followers

    @property
    def size(self) -> int:
        return len(self._procs) + 1

    # -- orders ---------------------------------------------------------------------------------
    def step(self, arrays: StepArrays) -> None:
        self._send(range(1, self.size), encode(Op.STEP, *step_arrays_to_wire(arrays)))

    def warm_up(self, full: bool) -> None:
        self._send(range(1, self.size), encode(Op.WARM_UP, np.array([int(full)])))

    def tell(self, rank: int, op: Op, *arrays: np.ndarray) -> None:
        """An order to one follower that wants no reply."""
        self._send([rank], encode(op, *arrays))

    def ask(self, rank: int, op: Op, *arrays: np.ndarray) -> Future[Message]:
        """An order to one follower; the future gets its reply, or RanksLost if the follower is gone."""
        future: Future[Message] = Future()
        with self._lock:
            number = next(self._numbers)
            self._pending[number] = future
        try:
            self._send([rank], encode(op, *arrays, number=number))
        except RanksLost:
            with self._lock:
                self._pending.pop(number, None)
            raise
        return future

    def _send(self, ranks: Sequence[int], data: bytes) -> None:
        with self._lock:
            if self._lost is not None:
                raise self._lost
            try:
                for rank in ranks:
                    self._pipes[rank - 1].send_bytes(data)
            except OSError as e:
                raise RanksLost(f"a tensor-parallel rank is gone ({e})") from e

    # -- replies and life -----------------------------------------------------------------------
    def _read(self) -> None:
        """Resolve the futures of ask() with the followers' replies; report the first follower that
        exits (or whose pipe closes) while this worker still runs."""
        sentinels = {proc.sentinel: proc for proc in self._procs}
        sources: list = [*self._pipes, *sentinels]
        while True:
            for ready in wait(sources):
                if ready in sentinels:
                    proc = sentinels[cast(int, ready)]
                    proc.join(1.0)
                    return self._lose(f"tensor-parallel rank {proc.name} (pid {proc.pid}) exited ({proc.exitcode})")
                try:
                    reply = decode(cast(Connection, ready).recv_bytes())
                except (EOFError, OSError):
                    return self._lose("the pipe of a tensor-parallel rank closed")
                with self._lock:
                    future = self._pending.pop(reply.number, None)
                if future is not None and future.set_running_or_notify_cancel():  # False: its caller left
                    future.set_result(reply)

    def _lose(self, reason: str) -> None:
        if self._closing.is_set():
            return
        lost = RanksLost(reason)
        with self._lock:
            self._lost = lost
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(lost)
        log.error("%s; this worker cannot step any more", lost)
        if self.on_lost is not None:
            self.on_lost(lost)

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
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        # It ends once a follower has; joined so that it never drops the last reference to these
        # groups itself: a daemon thread freeing a gloo group while the interpreter exits aborts it.
        self._reader.join(timeout_s)
        for pipe in self._pipes:
            pipe.close()


def _join_watching(procs: list, make: Callable[[], RankGroups]) -> RankGroups:
    """make() (which waits for every rank to join), unless a follower exits first (say it failed to
    import or load): then RanksLost at once rather than after the store's timeout."""
    result: Future[RankGroups] = Future()

    def run() -> None:
        try:
            result.set_result(make())
        except BaseException as e:  # handed to the caller, which raises it
            result.set_exception(e)

    threading.Thread(target=run, name="tp-ranks-join", daemon=True).start()
    while True:
        try:
            return result.result(timeout=0.2)
        except TimeoutError:
            dead = [p for p in procs if not p.is_alive()]
            if any(p.exitcode == MAIN_NOT_GUARDED_EXIT for p in dead):
                raise MainNotGuarded(
                    "tensor-parallel ranks could not start: each rank's process imports this script again "
                    "(multiprocessing's spawn), and its top level starts ranks too. Put the code that creates "
                    'the LLM (or Engine) under `if __name__ == "__main__":`'
                ) from None
            if dead:
                raise RanksLost(
                    f"tensor-parallel rank {dead[0].name} exited ({dead[0].exitcode}) before joining; see its log"
                ) from None


def _importing_main_to_spawn() -> bool:
    """True in a process being spawned by multiprocessing while it re-runs its parent's main module
    (the check multiprocessing makes before it refuses to start a process from there)."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def follow(config: EngineConfig, max_model_len: int, rank: int, port: int, pipe: Connection, threads: int) -> None:
    """A follower rank's process: join the groups, load the shard, then carry out rank 0's orders."""
    from splitserve.services.engine.model_runner import ModelRunner, resolve_device
    from splitserve.services.model.loader import open_model

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    torch.set_num_threads(threads)
    store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=START_TIMEOUT_S))
    device = rank_device(resolve_device(config.device), rank)
    groups = make_groups(store, rank, config.tensor_parallel_size, device)
    runner = ModelRunner(config, open_model(config.model), max_model_len, groups)
    # The KV transfers are disagg's (its transport and wire): the worker names their agent in the config.
    agent = config.rank_agent(runner, pipe.send_bytes) if config.rank_agent is not None else None
    follower = _Follower(runner, agent)
    try:
        while True:
            try:
                order = decode(pipe.recv_bytes())
            except EOFError:  # rank 0 is gone
                break
            if order.kind == Op.STOP:
                break
            follower.carry_out(order)
    finally:
        if agent is not None:
            agent.close()
    # Not a return into the interpreter's exit: the agent's thread (a daemon) may still hold the last
    # reference to the runner and its gloo groups, and a gloo group freed there while the interpreter
    # finalizes aborts the process ("terminate called without an active exception", exit -6).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Follower:
    """A follower's step loop: steps and commits here, transfers on the agent's thread. A STREAM_KV
    order comes just before the STEP that computes its blocks: that step marks the layers it writes
    in the progress the order's send waits on."""

    def __init__(self, runner: ModelRunner, agent: TransferAgent | None) -> None:
        self.runner, self._agent = runner, agent
        self._next_step: LayerProgress | None = None  # what the next STEP's streamed sends wait on

    @property
    def agent(self) -> TransferAgent:
        if self._agent is None:
            raise RuntimeError(
                "a KV transfer order reached a rank started without a transfer agent (EngineConfig.rank_agent)"
            )
        return self._agent

    def carry_out(self, order: Message) -> None:
        op, runner = Op(order.kind), self.runner
        if op is Op.STEP:
            layers, self._next_step = self._next_step, None
            try:
                runner.follow_step(step_arrays_from_wire(order.arrays), layers)
            except BaseException as e:
                if layers is not None:
                    layers.fail(e)
                raise
        elif op is Op.WARM_UP:
            runner.warm_up(bool(order.arrays[0][0]))
        elif op is Op.COMMIT_KV:
            tag, block_ids, heads = commit_from_wire(order.arrays)
            self.agent.commit(tag, lambda piece: runner.write_heads(block_ids, heads, piece))
        elif op is Op.STREAM_KV:
            if self._next_step is None:
                self._next_step = LayerProgress(runner.arch.num_layers, runner.device)
            self.agent.submit(order, self._next_step)
        else:
            self.agent.submit(order)
