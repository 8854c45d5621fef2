"""Triton paged attention: store_kv, then the paged decode and prefill kernels of splitserve.kernels;
and the model's RMSNorm (residual add fused), RoPE and SiLU-and-mul as kernels too (TritonOps).

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests only: the interpreter is slow). Triton and
splitserve.kernels are imported when the backend is checked (check_supported) or built, not when this
module is: Triton fixes at import whether kernels are compiled or interpreted, and a missing, too old
(< MIN_TRITON) or compiler-less Triton must only make this backend unavailable (the CUDA default then
falls back to torch and logs why).

No host syncs in forward: grid sizes and the split-K count come from the host copies in the metadata
(seq_lens_cpu, query_lens_cpu). A decode step captured in a CUDA graph (services/engine/cuda_graphs.py) freezes
what forward reads on the host: the number of sequences and of decodes (all of them), and the split
count, which the metadata then fixes (decode_num_splits, from graph_decode_splits: the count for the
longest context, correct for every shorter one). Split counts are powers of two, and
warm_up_decode_lens names a decode step for each, so an engine warm-up compiles every variant.

Argument checks: each kernel's wrapper checks its arguments (ranks, dtypes, shapes, devices, strides)
on its first launch through a backend only. They are the model's tensors, built the same way every
step; checking them again on each of the tens of launches per layer per step would cost more host
time than the launches at small batch. The kernel tests call the wrappers with their checks on.
"""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

from splitserve.services.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    ModelOps,
    register_backend,
)

MIN_TRITON = "3.4"  # splitserve.kernels read triton.knobs, new in Triton 3.4 (torch 2.8 ships it)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_triton_version() -> str:
    """Import triton; raise RuntimeError unless it is one the kernels support. Returns its version."""
    try:
        import triton
    except ImportError as e:
        raise RuntimeError(f"triton is installed but does not import ({e})") from e
    version = getattr(triton, "__version__", "unknown")
    if not hasattr(triton, "knobs"):  # the API the kernels need, whatever the version string says
        raise RuntimeError(
            f"triton {version} is too old: splitserve.kernels need triton >= {MIN_TRITON} "
            "(triton.knobs; torch >= 2.8 ships it)"
        )
    return version


def _check_compiler(version: str) -> None:
    """Compiled Triton builds a small C launcher per kernel: it needs a C compiler, as Triton looks
    for one ($CC, gcc or clang). CUDA `-runtime` images lack one."""
    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
        raise RuntimeError(
            f"triton {version} needs a C compiler to build its kernel launchers and none was "
            "found (set CC, or install gcc)"
        )


def _import_kernels(version: str) -> None:
    try:
        import splitserve.kernels  # noqa: F401
    except (ImportError, AttributeError) as e:  # a Triton API the kernels use is missing
        raise RuntimeError(f"splitserve.kernels do not import with triton {version} ({e})") from e


class FirstLaunches:
    """Which kernels a backend has launched: check(name) is True on a kernel's first launch only (its
    wrapper checks its arguments then; see the module docstring)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def check(self, kernel: str) -> bool:
        if kernel in self._seen:
            return False
        self._seen.add(kernel)
        return True


class TritonOps(ModelOps):
    """ModelOps on splitserve.kernels, rounding as the torch versions do (see the kernels' docstrings)."""

    def __init__(self, kernels, launches: FirstLaunches) -> None:
        self.kernels = kernels
        self.launches = launches

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps, check=self.launches.check("rms_norm"))

    def add_rms_norm(self, x, residual, weight, eps):
        check = self.launches.check("add_rms_norm")
        return self.kernels.rms_norm(x, weight, eps, residual=residual, check=check), residual  # residual += x

    def rope_lookup(self, cos, sin, positions, dtype):
        # The kernel reads float32 [max_len, head_dim // 2] rows (strided views) by position itself.
        half = cos.shape[1] // 2
        return positions, cos[:, :half], sin[:, :half]

    def rotate(self, q, k, rope):
        positions, cos, sin = rope
        self.kernels.rotary_embedding(positions, q, k, cos, sin, check=self.launches.check("rotary"))  # in place
        return q, k

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up, check=self.launches.check("silu_and_mul"))


@register_backend
class TritonAttention(AttentionBackend):
    name = "triton"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        """Triton importable, new enough, a C compiler on CUDA, and splitserve.kernels importable."""
        if not triton_installed():
            raise RuntimeError(
                f"the 'triton' attention backend needs the triton package (pip install 'triton>={MIN_TRITON}')"
            )
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            raise RuntimeError(
                f"the 'triton' attention backend runs on CUDA, or on CPU only under the Triton "
                f"interpreter (TRITON_INTERPRET=1, slow, for tests); device is {device}"
            )
        version = _check_triton_version()
        if not interpreted:
            _check_compiler(version)
        # Raises RuntimeError if triton was imported before TRITON_INTERPRET was set.
        _import_kernels(version)

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, decode_mirror_bytes: int | None = 0
    ) -> None:
        # decode_mirror_bytes: unused, the kernels read the paged cache directly
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, decode_mirror_bytes)
        from splitserve import kernels

        self.kernels = kernels
        self.launches = FirstLaunches()
        self.ops = TritonOps(kernels, self.launches)

    def warm_up_decode_lens(self, max_seq_len: int, device: torch.device) -> list[int]:
        from splitserve.kernels.paged_decode import decode_warm_up_lens, sm_count

        return list(decode_warm_up_lens(self.num_kv_heads, max_seq_len, sm_count(device)).values())

    def graph_decode_splits(self, num_seqs: int, max_seq_len: int, device: torch.device) -> int | None:
        # What the wrapper would choose for num_seqs sequences of max_seq_len: a power of two that the
        # warm-up compiled; for shorter contexts the trailing splits are empty, which the merge handles.
        from splitserve.kernels.paged_decode import choose_num_splits, sm_count

        return choose_num_splits(num_seqs, self.num_kv_heads, max_seq_len, sm_count(device))

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        kernels, nd, launches = self.kernels, meta.num_decodes, self.launches
        kernels.store_kv(k, v, kv_cache, meta.slot_mapping, check=launches.check("store_kv"))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view of qkv
        if nd:  # decodes come first, one token each
            kernels.paged_decode_attention(
                q[:nd],
                kv_cache,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                self.scale,
                max_seq_len=None if meta.decode_num_splits else max(meta.seq_lens_cpu[:nd]),
                num_splits=meta.decode_num_splits,
                out=out[:nd],
                check=launches.check("paged_decode"),
            )
        if nd < meta.num_seqs:
            kernels.paged_prefill_attention(
                q[nd:],
                kv_cache,
                meta.block_tables[nd:],
                meta.seq_lens[nd:],
                meta.query_start_loc[nd:],
                self.scale,
                max_query_len=max(meta.query_lens_cpu[nd:]),
                out=out[nd:],
                check=launches.check("paged_prefill"),
            )
        return out
