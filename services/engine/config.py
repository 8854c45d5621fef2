"""Engine configuration: frozen, validated at construction. Values found at run time (number of KV
blocks, EOS ids, the model's context) live in RuntimeInfo, never written back here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.services.engine.model_runner import ModelRunner
    from splitserve.services.engine.ranks import TransferAgent

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for K and V of all layers. None: 512 MiB on CPU; on CUDA, gpu_memory_fraction of the device's
    # total memory minus the weights and the peak of a profiling forward (services/engine/memory.py).
    kv_cache_bytes: int | None = None
    gpu_memory_fraction: float = 0.85
    # CPU: bytes (all layers) for contiguous copies of the decoding sequences' K/V kept across steps, which
    # spare each decode step a gather of every context (services/model/attention/decode_mirror.py). None: up to the
    # KV cache's own size; 0: none (decodes gather from the paged cache at every step).
    decode_mirror_bytes: int | None = None
    enable_prefix_caching: bool = True
    # Prefill tier: how long a finished prompt's blocks wait for their sender to claim them.
    kv_lease_s: float = 30.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.decode_mirror_bytes is not None and self.decode_mirror_bytes < 0:
            raise ValueError(f"decode_mirror_bytes must be >= 0, got {self.decode_mirror_bytes}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")
        if not self.kv_lease_s > 0:
            raise ValueError(f"kv_lease_s must be > 0, got {self.kv_lease_s}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens must be >= max_num_seqs ({self.max_num_batched_tokens} < {self.max_num_seqs})"
            )
        if self.policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {self.policy!r}")


@dataclass(frozen=True, slots=True)
class CudaGraphConfig:
    """Decode steps replayed from CUDA graphs (services/engine/cuda_graphs.py), captured by the warm-up at batch
    sizes 1, 2, 4, ... up to min(max_num_seqs, max_batch_size). Off by default: never run on a GPU yet
    (`make gpu-check` compares it with eager steps; turn it on once that passes)."""

    enabled: bool = False
    max_batch_size: int = 256  # the largest captured decode batch (vLLM's largest default size)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"cuda graph max_batch_size must be >= 1, got {self.max_batch_size}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # HF folder or .gguf file; None: the bundled SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    attention_backend: str | None = None  # None: the device's default backend
    max_model_len: int | None = None  # None: the model's context length
    seed: int = 0
    # Ranks per worker (services/engine/ranks.py): the model and the KV cache sharded by head (Megatron style).
    tensor_parallel_size: int = 1
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cuda_graphs: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    # A follower rank's KV transfer agent, made from its runner and its send to rank 0: a worker names
    # disagg's (services/disagg/rank_transfers.py RankAgent, pickled by name into each rank); None (the
    # offline engine): the ranks take no transfer orders.
    rank_agent: Callable[[ModelRunner, Callable[[bytes], None]], TransferAgent] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """Facts the engine learned while starting: what the scheduler and validation need."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size
