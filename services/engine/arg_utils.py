"""The engine's command-line flags and the EngineConfig they build (as vLLM keeps EngineArgs beside its
config): shared by `splitserve generate`, `worker`, `up` (which passes them on to every worker) and
`profile`."""

from __future__ import annotations

import argparse

from splitserve.services.engine.config import CacheConfig, CudaGraphConfig, EngineConfig, SchedulerConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model", default=None, help="Hugging Face folder or .gguf file (default: bundled SmolLM2-135M-Instruct)"
    )
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="ranks per worker, the model sharded over them by head (on CUDA rank r uses cuda:N+r)",
    )
    g.add_argument("--attention-backend", default=None, help="attention backend name (default: per device)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache budget in bytes")
    g.add_argument(
        "--decode-mirror-bytes",
        type=int,
        default=None,
        help="CPU: bytes for contiguous copies of the decoding sequences' K/V kept across steps (default: "
        "up to the KV cache's size; 0: off, every decode step gathers its context from the paged cache)",
    )
    g.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.85,
        help="CUDA: share of the device's total memory this worker may use (weights, activations, KV)",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="run each prompt in one step (requests over --max-num-batched-tokens are refused)",
    )
    g.add_argument(
        "--kv-lease-s",
        type=float,
        default=30.0,
        help="prefill tier: release a finished prompt's KV blocks if no send claims them in this time",
    )
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="replay decode steps from CUDA graphs captured at warm-up (CUDA, triton backend, one rank). "
        "Off by default: untested on a GPU until `make gpu-check` passes there",
    )
    g.add_argument(
        "--cuda-graph-max-batch",
        type=int,
        default=CudaGraphConfig().max_batch_size,
        help="largest decode batch captured (sizes 1, 2, 4, ... up to min(this, --max-num-seqs))",
    )


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        dtype=a.dtype,
        device=a.device,
        tensor_parallel_size=a.tensor_parallel_size,
        attention_backend=a.attention_backend,
        max_model_len=a.max_model_len,
        seed=a.seed,
        cache=CacheConfig(
            block_size=a.block_size,
            kv_cache_bytes=a.kv_cache_bytes,
            decode_mirror_bytes=a.decode_mirror_bytes,
            enable_prefix_caching=not a.no_prefix_caching,
            kv_lease_s=a.kv_lease_s,
            gpu_memory_fraction=a.gpu_memory_fraction,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            policy=a.policy,
            enable_chunked_prefill=not a.no_chunked_prefill,
        ),
        cuda_graphs=CudaGraphConfig(enabled=a.cuda_graphs, max_batch_size=a.cuda_graph_max_batch),
    )
