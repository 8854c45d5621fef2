"""Owns the model weights and the paged KV cache tensors; runs one packed forward per step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.cuda_graphs import Capture, DecodeGraphs, GraphTarget, capture_sizes, default_capture
from splitserve.services.engine.kv_cache.block_io import gather_blocks, scatter_blocks
from splitserve.services.engine.kv_cache.staging import Staging, StagingPool
from splitserve.services.engine.layer_progress import LayerProgress
from splitserve.services.engine.memory import MemorySnapshot, profile_memory
from splitserve.services.engine.ranks import Followers, RankGroups, RanksLost, rank_device
from splitserve.services.engine.scheduler import SchedulerOutput
from splitserve.services.engine.step_inputs import ForwardBatch, StepArrays, StepInputBuffer, scheduled_arrays
from splitserve.services.model.arch import ModelArchConfig
from splitserve.services.model.attention import get_backend
from splitserve.services.model.loader import ModelSource, build_model
from splitserve.services.model.parallel import TensorParallel

_DEFAULT_CPU_KV_BYTES = 512 * 1024**2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
log = logging.getLogger("splitserve.services.engine")


def resolve_device(name: str) -> torch.device:
    """The device to run on; a CUDA device always with its index (threads are bound to it)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise RuntimeError("device cuda was asked for but torch sees no CUDA device")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def bind_thread(device: torch.device) -> None:
    """Make device the calling thread's current CUDA device, where Triton launches its kernels (torch
    ops follow their tensors); nothing to do elsewhere. Call it in every thread that runs steps."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_block_bytes(arch: ModelArchConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """Bytes of one block across all layers, K and V (of num_kv_heads heads: default all of them)."""
    elem = torch.empty((), dtype=dtype).element_size()
    heads = arch.num_kv_heads if num_kv_heads is None else num_kv_heads
    return arch.num_layers * 2 * block_size * heads * arch.head_dim * elem


class StepShape(NamedTuple):
    """The shape of one step without its data: what a warm-up or profiling forward runs."""

    seq_lens: tuple[int, ...]  # context of each sequence, this step's tokens included
    query_lens: tuple[int, ...]  # this step's tokens of each sequence; decodes (1) first


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    num_steps: int
    seconds: float  # the steps and the graph captures
    num_graphs: int = 0  # decode batch sizes captured in CUDA graphs (services/engine/cuda_graphs.py)


class ModelRunner:
    """One rank's model shard and KV cache. Rank 0 (groups None) is the engine's: with
    config.tensor_parallel_size N > 1 it starts the other N - 1 ranks (services/engine/ranks.py) and drives
    their steps; a follower rank is built with its groups. Each rank's cache holds its KV heads
    only, and KV handoffs read and write each rank's heads where they are (read_heads / write_heads)."""

    def __init__(
        self, config: EngineConfig, source: ModelSource, max_model_len: int, groups: RankGroups | None = None
    ) -> None:
        device = resolve_device(config.device)
        self.followers: Followers | None = None
        if groups is None and config.tensor_parallel_size > 1:
            TensorParallel(0, config.tensor_parallel_size).check(source.arch)  # refuse before spawning
            self.followers = Followers.start(config, max_model_len, device)
            groups = self.followers.groups
        self.groups = groups or RankGroups()
        self.tp = self.groups.tp
        self.device = rank_device(device, self.tp.rank)
        bind_thread(self.device)  # this thread loads and profiles (and steps, under LLM / a bare Engine)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.arch = source.arch
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.scheduler_config = config.scheduler
        self.graph_config = config.cuda_graphs
        self._graphs: DecodeGraphs | None = None  # captured by warm_up when graph_config asks
        backend_cls = get_backend(config.attention_backend, self.device)
        num_heads, self.num_local_kv_heads = self.tp.local_heads(self.arch)
        mirror = config.cache.decode_mirror_bytes  # all layers' -> each layer's
        mirror = mirror if mirror is None else mirror // self.arch.num_layers
        self.backend = backend_cls(num_heads, self.num_local_kv_heads, self.arch.head_dim, self.block_size, mirror)
        before_load = MemorySnapshot.take(self.device) if self.device.type == "cuda" else None
        self.model = build_model(source, self.backend, max_model_len, self.dtype, self.device, self.tp)
        self.num_blocks = self._agree(self._num_kv_blocks(config, max_model_len, before_load))
        # [num_layers, 2, num_blocks, block_size, local kv heads, head_dim]; see attention/backend.py
        self.kv_cache = self._new_kv_cache(self.num_blocks)
        self.kv_caches = list(self.kv_cache.unbind(0))
        self._staging: StagingPool | None = None
        self._inputs = StepInputBuffer(self.device, self.block_size)
        self._kv_written = False  # by a step or a KV transfer: warm_up may no longer scribble on block 0

    def _new_kv_cache(self, num_blocks: int) -> torch.Tensor:
        a = self.arch
        shape = (a.num_layers, 2, num_blocks, self.block_size, self.num_local_kv_heads, a.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _agree(self, num_blocks: int) -> int:
        """Every rank's cache has the same number of blocks: the smallest any rank can hold."""
        if self.groups.host is None:
            return num_blocks
        count = torch.tensor([num_blocks], dtype=torch.int64)
        self.groups.host.allreduce([count], dist.ReduceOp.MIN).wait()
        return int(count.item())

    @property
    def kv_layout(self) -> str:
        """What must match between two workers for KV blocks to move between them: the global layout
        (every KV head), whatever each worker's tensor-parallel size; each rank moves its heads."""
        dtype = str(self.dtype).removeprefix("torch.")
        a = self.arch
        return f"{dtype}/layers={a.num_layers}/block={self.block_size}/kv_heads={a.num_kv_heads}/head_dim={a.head_dim}"

    @property
    def staging(self) -> StagingPool:
        """Reused host buffers for KV transfers (made on first use), counted in whole blocks."""
        if self._staging is None:
            a = self.arch
            self._staging = StagingPool((a.num_layers, 2, self.block_size, a.num_kv_heads, a.head_dim), self.dtype)
        return self._staging

    def acquire_piece(self, num_blocks: int, num_heads: int) -> Staging:
        """A staging buffer for num_heads KV heads of num_blocks blocks: [layers, 2, n, block_size,
        num_heads, head_dim] (release it to self.staging)."""
        a = self.arch
        whole = self.staging.acquire(-(-num_blocks * num_heads // a.num_kv_heads))
        shape = (a.num_layers, 2, num_blocks, self.block_size, num_heads, a.head_dim)
        numel = int(np.prod(shape))
        return Staging(whole.storage[:numel].view(shape), whole.storage, whole.capacity)

    def local_heads(self, heads: range) -> slice:
        """Where global KV heads sit in this rank's cache; ValueError if it does not hold them all."""
        mine = self.tp.kv_head_range(self.arch.num_kv_heads)
        if not (len(heads) and mine.start <= heads.start and heads.stop <= mine.stop):
            raise ValueError(f"rank {self.tp.rank} holds KV heads {mine.start}..{mine.stop - 1}, not {heads}")
        return slice(heads.start - mine.start, heads.stop - mine.start)

    def read_heads(self, block_ids: Sequence[int], heads: range, out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous host copy of these KV heads (global) of these blocks: [num_layers, 2,
        len(block_ids), block_size, len(heads), head_dim], into out when given (a staging buffer)."""
        local = self.local_heads(heads)
        if local == slice(0, self.num_local_kv_heads) and self.kv_cache.device.type == "cpu":
            return gather_blocks(self.kv_cache, block_ids, out)
        blocks = gather_blocks(self.kv_cache, block_ids)[:, :, :, :, local]
        return blocks.cpu().contiguous() if out is None else out.copy_(blocks)

    def write_heads(self, block_ids: Sequence[int], heads: range, piece: torch.Tensor) -> None:
        """Inverse of read_heads: piece[:, :, i] goes to these KV heads of block block_ids[i]."""
        self.row_writer(block_ids, heads, piece)(slice(None))

    def row_writer(self, block_ids: Sequence[int], heads: range, piece: torch.Tensor) -> Callable[[slice], None]:
        """write_heads a range of rows at a time: write(rows) puts rows [start, stop) of piece's
        [num_layers * 2, -1] view (layer and K/V) into these KV heads of these blocks, so a receive
        can write each chunk as it lands. Beside a step only into blocks no step reads (pinned)."""
        self._kv_written = True
        local = self.local_heads(heads)
        if local == slice(0, self.num_local_kv_heads):
            return lambda rows: scatter_blocks(self.kv_cache, block_ids, piece, rows)
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        cache = self.kv_cache.flatten(0, 1)  # a view: [num_layers * 2, num_blocks, block_size, heads, head_dim]
        source = piece.flatten(0, 1)

        def write(rows: slice) -> None:
            cache[rows, index, :, local] = source[rows].to(self.device, self.dtype)

        return write

    def _num_kv_blocks(self, config: EngineConfig, max_model_len: int, before_load: MemorySnapshot | None) -> int:
        budget, source = self._kv_cache_bytes(config, max_model_len, before_load)
        per_block = kv_block_bytes(self.arch, self.block_size, self.dtype, self.num_local_kv_heads)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"the KV cache budget of {budget} bytes ({source}) is below one KV block ({per_block} bytes)"
            )
        log.info(
            "KV cache: %d blocks of %d tokens, %.2f GiB (%s)",
            num_blocks,
            self.block_size,
            num_blocks * per_block / 1024**3,
            source,
        )
        return num_blocks

    def _kv_cache_bytes(
        self, config: EngineConfig, max_model_len: int, before_load: MemorySnapshot | None
    ) -> tuple[int, str]:
        """(KV cache budget in bytes, where it comes from)."""
        cache = config.cache
        if cache.kv_cache_bytes is not None:
            return cache.kv_cache_bytes, "--kv-cache-bytes"
        if before_load is None:
            return _DEFAULT_CPU_KV_BYTES, "the CPU default"
        sched = config.scheduler
        profile = profile_memory(
            self.device,
            before_load,
            lambda: self.profile_forward(sched.max_num_batched_tokens, sched.max_num_seqs, max_model_len),
        )
        return profile.kv_cache_bytes(cache.gpu_memory_fraction), profile.describe(cache.gpu_memory_fraction)

    def prepare(self, out: SchedulerOutput) -> ForwardBatch:
        """The step's inputs on the device (valid until the next prepare: the host buffer is reused)."""
        return self._inputs.pack(scheduled_arrays(out), out.sampling_requests(), out)

    @torch.inference_mode()
    def profile_forward(self, num_tokens: int, max_num_seqs: int, max_model_len: int) -> None:
        """One forward as large as a step can be: num_tokens tokens over as many sequences as may run,
        every one sampling, on a scratch KV cache just big enough (counted as activations: a slight
        overestimate, on the safe side). What the memory budget measures."""
        lens = tuple(_profile_seq_lens(num_tokens, max_num_seqs, max_model_len))
        block_ids = self._own_blocks(lens)
        scratch = self._new_kv_cache(sum(map(len, block_ids)))
        self._run_shape(StepShape(lens, lens), block_ids, list(scratch.unbind(0)))

    def _own_blocks(self, seq_lens: Sequence[int]) -> list[list[int]]:
        """Block ids 0, 1, 2, ... handed out in order: every sequence on blocks of its own."""
        block_ids, next_block = [], 0
        for n in seq_lens:
            block_ids.append(list(range(next_block, next_block + -(-n // self.block_size))))
            next_block += len(block_ids[-1])
        return block_ids

    @torch.inference_mode()
    def warm_up(self, full: bool | None = None, capture: Capture | None = None) -> WarmUpReport:
        """Run once every step shape whose kernels a step could otherwise compile while serving
        (warm_up_shapes: the token budget's step and a decode per split count of the backend), on the
        real KV cache, so its strides and sizes are the ones compiled for. full: that plan (None: on CUDA
        only; elsewhere nothing compiles and one small step runs the path once). Then, if the config
        enables them, capture the decode graphs (capture: how; None: CUDA graphs on a CUDA device).

        Call it before the first step or KV transfer: every sequence's blocks are block 0, which it
        fills with scratch values."""
        if self._kv_written:
            raise RuntimeError("warm_up must run before the first step or KV transfer: it overwrites KV block 0")
        bind_thread(self.device)  # Triton compiles and launches for the calling thread's device
        start = time.perf_counter()
        full = self.device.type == "cuda" if full is None else full
        if self.followers is not None:
            self.followers.warm_up(full)
        decode_lens = self.backend.warm_up_decode_lens(self.max_model_len, self.device) if full else []
        sched = self.scheduler_config
        shapes = warm_up_shapes(sched.max_num_batched_tokens, sched.max_num_seqs, self.max_model_len, decode_lens, full)
        for shape in shapes:
            self._run_shape(shape, [[0] * -(-n // self.block_size) for n in shape.seq_lens], self.kv_caches)
        num_graphs = self._capture_graphs(capture)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return WarmUpReport(len(shapes), time.perf_counter() - start, num_graphs)

    def _capture_graphs(self, capture: Capture | None) -> int:
        """Record the decode graphs if the config asks for them (services/engine/cuda_graphs.py); how many."""
        if not self.graph_config.enabled:
            return 0
        capture = capture or default_capture(self.device)
        reason = self._no_graphs_reason(capture)
        if capture is None or reason is not None:
            log.warning("CUDA graphs off: %s; decode steps run eagerly", reason)
            return 0
        sizes = capture_sizes(self.scheduler_config.max_num_seqs, self.graph_config.max_batch_size)
        start = time.perf_counter()
        target = GraphTarget(self.model, self.backend, self.kv_caches, self.max_model_len, self.block_size, self.device)
        self._graphs = DecodeGraphs.capture(target, sizes, capture)
        seconds = time.perf_counter() - start
        log.info("CUDA graphs: %d decode batch sizes (%s) captured in %.2f s", len(sizes), sizes, seconds)
        return len(sizes)

    def _no_graphs_reason(self, capture: Capture | None) -> str | None:
        if capture is None:
            return f"they need a CUDA device, not {self.device}"
        if self.tp.size > 1:  # rank 0 alone would replay: its collectives would wait on followers forever
            return "tensor parallel: the follower ranks do not capture graphs (yet)"
        if self.backend.graph_decode_splits(1, self.max_model_len, self.device) is None:
            return f"the {self.backend.name} attention backend cannot replay decodes (use --attention-backend triton)"
        return None

    def shape_forward(self, shape: StepShape) -> Callable[[], None]:
        """A callable running one forward of shape (token 0 at every position, each sequence's last token
        sampling) on this runner's KV cache, every sequence on blocks of its own (replayed from a decode
        graph where a served step would be): what `splitserve profile` times. It overwrites KV blocks:
        only on a runner that serves nothing. ValueError if the shape's blocks do not fit, or on a
        tensor-parallel runner (its followers step only with a real step)."""
        if self.followers is not None:
            raise ValueError("shapes are timed on one rank: profile with --tensor-parallel-size 1")
        block_ids = self._own_blocks(shape.seq_lens)
        num_blocks = sum(map(len, block_ids))
        if num_blocks > self.num_blocks:
            raise ValueError(f"the shape needs {num_blocks} KV blocks; the cache holds {self.num_blocks}")
        self._kv_written = True

        @torch.inference_mode()
        def run() -> None:
            self._run_shape(shape, block_ids, self.kv_caches)

        return run

    def _run_shape(self, shape: StepShape, block_ids: list[list[int]], kv_caches: list[torch.Tensor]) -> None:
        """One forward of token 0 at every position of shape, each sequence's last token sampling."""
        query_lens = np.array(shape.query_lens, dtype=np.int64)
        table = np.zeros((len(block_ids), max(len(ids) for ids in block_ids)), dtype=np.int64)
        for row, ids in zip(table, block_ids):
            row[: len(ids)] = ids
        starts = np.array(shape.seq_lens, dtype=np.int64) - query_lens
        arrays = StepArrays(np.zeros(int(query_lens.sum()), dtype=np.int64), starts, query_lens, table, query_lens > 0)
        batch = self._inputs.pack(arrays, [])
        hidden = self._hidden(batch, kv_caches)
        self.model.compute_logits(hidden[batch.sample_rows])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, layers: LayerProgress | None = None) -> torch.Tensor:
        """Run the step (on every rank); returns float32 logits [num_sampling_seqs, vocab]. layers: marked
        as each layer's KV is written (a prefill worker streams a prompt's KV as it is computed)."""
        if self.followers is None:
            return self._forward(batch, layers)
        assert batch.arrays is not None  # prepare() packs from arrays
        self.followers.step(batch.arrays)
        try:
            return self._forward(batch, layers)
        except Exception as e:  # the followers may be inside a collective of this step: out of step for good
            raise RanksLost(f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})") from e

    @torch.inference_mode()
    def follow_step(self, arrays: StepArrays, layers: LayerProgress | None = None) -> None:
        """A follower rank's side of rank 0's step (its logits are rank 0's to sample); layers: marked
        as each layer's KV is written (this rank's pieces of a streamed handoff wait on it)."""
        self._forward(self._inputs.pack(arrays, []), layers)

    def _forward(self, batch: ForwardBatch, layers: LayerProgress | None = None) -> torch.Tensor:
        self._kv_written = True
        hidden = self._hidden(batch, self.kv_caches, layers)
        if batch.sample_rows.numel() == 0:  # the same test on every rank: compute_logits has collectives
            return hidden.new_empty((0, self.arch.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_rows])

    def _hidden(
        self, batch: ForwardBatch, kv_caches: list[torch.Tensor], layers: LayerProgress | None = None
    ) -> torch.Tensor:
        """The model's output [num_tokens, hidden]: from a decode graph when one fits the step (graphs
        run on self.kv_caches only, and mark no layers), else eagerly."""
        if self._graphs is not None and kv_caches is self.kv_caches and layers is None:
            hidden = self._graphs.try_forward(batch)
            if hidden is not None:
                return hidden
        on_layer = None if layers is None else layers.layer_done
        return self.model(batch.input_ids, batch.positions, kv_caches, batch.meta, on_layer)

    def on_ranks_lost(self, callback) -> None:
        """callback(RanksLost), from another thread, when a follower rank exits (tensor parallel only)."""
        if self.followers is not None:
            self.followers.on_lost = callback

    def close(self) -> None:
        """Stop the follower ranks (nothing to do without tensor parallelism)."""
        if self.followers is not None:
            self.followers.close()


def warm_up_shapes(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, decode_lens: Sequence[int], on_gpu: bool
) -> list[StepShape]:
    """The steps a warm-up runs. On a GPU: the largest step (the profiling shape: one-token decodes and
    prompts filling the token budget) and one single-sequence decode per length in decode_lens (each
    reaches another compiled decode variant). Elsewhere nothing is compiled: one small step, a decode
    next to a short prompt when the limits allow it."""
    if on_gpu:
        lens = tuple(_profile_seq_lens(max_num_batched_tokens, max_num_seqs, max_model_len))
        return [StepShape(lens, lens)] + [StepShape((n,), (1,)) for n in decode_lens]
    prompt = min(8, max_model_len, max_num_batched_tokens - 1)
    if max_num_seqs < 2 or prompt < 1:
        prompt = min(8, max_model_len, max_num_batched_tokens)
        return [StepShape((prompt,), (prompt,))]
    return [StepShape((2, prompt), (1, prompt))]


def _profile_seq_lens(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Sequence lengths of the profiling step: max_num_seqs - 1 one-token sequences (decodes, each
    sampling a row of logits) and the rest of the tokens in as few prompts as max_model_len allows
    (the longest attention)."""
    num_single = min(max_num_seqs, num_tokens) - 1
    rest = num_tokens - num_single
    return [1] * num_single + [min(max_model_len, rest - i) for i in range(0, rest, max_model_len)]
