"""Megatron-style tensor parallelism: a model built for rank r of N holds only its shard of each weight,
and after its collectives produces the logits of the whole model on every rank.

Per decoder layer: qkv_proj and gate_up_proj are column-parallel (this rank's output rows: its query
heads, its KV heads, its slice of the intermediate size), so attention and SiLU-and-mul run on local
heads and columns without talking; o_proj and down_proj are row-parallel (this rank's input columns)
and end in one all_reduce each. The embedding and the LM head are split over the vocab (padded up to
a multiple of the size): an all_reduce after the lookup, an all_gather of the logits. Norms and the
RoPE table are replicated. Size 1 is the plain model: the same parameter shapes, no collectives.

KV heads: with size <= num_kv_heads each rank holds num_kv_heads / size of them; with more ranks than
KV heads, each KV head is replicated on the size / num_kv_heads ranks whose query heads read it.

The group is a raw ProcessGroup (gloo on CPU, NCCL on CUDA), never registered as torch.distributed's
default group: a worker also makes pair groups of its own at run time (KV transfers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.services.model.arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in its worker's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: object | None = None  # a raw ProcessGroup (e.g. dist.ProcessGroupGloo); None when size == 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of size {self.size}: need 0 <= rank < size")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, written into x (which must be contiguous); x itself at size 1."""
        if self.size == 1:
            return x
        self._group().allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order; x itself at size 1."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._group().allgather([parts], [x]).wait()
        return torch.cat(parts, dim=dim)

    def _group(self):
        if self.group is None:
            raise RuntimeError(f"tensor-parallel size {self.size} needs a process group; none was given")
        return self.group

    def shard(self, total: int) -> range:
        """This rank's equal part of range(total) (total a multiple of size)."""
        part = total // self.size
        return range(self.rank * part, (self.rank + 1) * part)

    def kv_head_range(self, num_kv_heads: int) -> range:
        """The global KV heads this rank holds: its own share, or, with more ranks than KV heads, the
        one head its query heads share (replicated on size / num_kv_heads ranks)."""
        if self.size <= num_kv_heads:
            return self.shard(num_kv_heads)
        head = self.rank * num_kv_heads // self.size
        return range(head, head + 1)

    def local_heads(self, arch: ModelArchConfig) -> tuple[int, int]:
        """(query heads, KV heads) on this rank: what its attention backend and KV cache are built for."""
        return arch.num_heads // self.size, len(self.kv_head_range(arch.num_kv_heads))

    def vocab_per_rank(self, vocab_size: int) -> int:
        """Rows of the embedding / LM head on each rank: the vocab padded up to a multiple of size, split."""
        return -(-vocab_size // self.size)

    def vocab_range(self, vocab_size: int) -> range:
        """The real (not padding) vocab ids this rank holds: its rows 0 .. len - 1."""
        per_rank = self.vocab_per_rank(vocab_size)
        return range(min(self.rank * per_rank, vocab_size), min((self.rank + 1) * per_rank, vocab_size))

    def check(self, arch: ModelArchConfig) -> None:
        """ValueError, naming the sizes that would work, unless this size can shard arch."""
        problem = _why_not(arch, self.size)
        if problem:
            sizes = ", ".join(str(s) for s in possible_sizes(arch))
            raise ValueError(
                f"tensor-parallel size {self.size} cannot shard this {arch.architecture}: {problem}. "
                f"Sizes that can: {sizes}"
            )


SINGLE = TensorParallel()


def _why_not(arch: ModelArchConfig, size: int) -> str | None:
    """Why size cannot shard arch (None: it can)."""
    heads, kv_heads, inter = arch.num_heads, arch.num_kv_heads, arch.intermediate_size
    if heads % size:
        return f"its {heads} query heads do not split evenly over {size} ranks"
    if size <= kv_heads and kv_heads % size:
        return f"its {kv_heads} KV heads do not split evenly over {size} ranks"
    if size > kv_heads and size % kv_heads:
        return f"{size} ranks are not a multiple of its {kv_heads} KV heads (each KV head is replicated)"
    if inter % size:
        return f"its intermediate size {inter} does not split evenly over {size} ranks"
    return None


def possible_sizes(arch: ModelArchConfig) -> list[int]:
    """Every tensor-parallel size that can shard arch (divisors of the query head count that pass)."""
    return [s for s in range(1, arch.num_heads + 1) if _why_not(arch, s) is None]


class ColumnParallelLinear(nn.Linear):
    """This rank's output rows of a linear layer (weight [local_out, in]); the output stays sharded
    (local heads / intermediate columns), so there is no communication: a RowParallelLinear follows."""

    def __init__(self, in_features: int, local_out_features: int, bias: bool) -> None:
        super().__init__(in_features, local_out_features, bias=bias)


class RowParallelLinear(nn.Linear):
    """This rank's input columns of a linear layer (weight [out, local_in]), fed the sharded output of
    a column-parallel layer; one all_reduce sums the partial outputs. No bias (it would be added size times)."""

    def __init__(self, local_in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(local_in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))  # [num_tokens, out], summed over ranks


class VocabParallelEmbedding(nn.Embedding):
    """Rows vocab_range of the embedding (weight [vocab_per_rank, hidden], padding rows last). Ids held
    elsewhere look up zeros here, so the all_reduce (a sum) is the full lookup on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(tp.vocab_per_rank(vocab_size), hidden_size)
        self.tp = tp
        self.held = tp.vocab_range(vocab_size)

    def reset_parameters(self) -> None:
        # Zeros, not nn.Embedding's normal_: the weights are loaded anyway, and normal_ on the meta
        # device (build_model) imports torch._dynamo, ~2 s of every rank's start-up.
        nn.init.zeros_(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [num_tokens, hidden]
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.held.start
        outside = (local < 0) | (local >= len(self.held))
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))


class ParallelLMHead(nn.Linear):
    """The LM head split over the vocab like VocabParallelEmbedding (whose weight it shares when tied):
    local logits, gathered along the vocab and trimmed of the padding, so every rank gets them all."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel) -> None:
        super().__init__(hidden_size, tp.vocab_per_rank(vocab_size), bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab_size]
        logits = F.linear(x, self.weight)  # [n, vocab_per_rank]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[:, : self.vocab_size]
