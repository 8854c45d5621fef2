"""One layer's decode attention on CPU: the decode mirror (contiguous K/V copies kept across steps,
services/model/attention/decode_mirror.py) against the paged gather, over batches of uniform and of mixed
context lengths (SmolLM2-135M's heads: 9 query, 3 KV, head_dim 64; blocks of 16).

Per case: the same sequences step together (each context one token longer per step) through two
TorchAttention backends, one with the mirror and one without (decode_mirror_bytes=0). Each step's
first layer (which builds the step's plan) runs untimed on a cache of its own; the second layer is
timed. Medians over --steps steps after 5 warm-up steps. Also the host cost of the mirror's slot plan.

Usage: python benchmarks/decode_mirror.py [--threads 1] [--steps 30] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from splitserve.services.model.attention.backend import AttentionMetadata
from splitserve.services.model.attention.decode_mirror import DecodeMirror
from splitserve.services.model.attention.torch_backend import TorchAttention

H, KVH, D, BS = 9, 3, 64, 16
CASES: dict[str, Callable[[random.Random], int]] = {
    "uniform 300": lambda rng: 300,
    "U[100, 700]": lambda rng: rng.randint(100, 700),
    "U[32, 768]": lambda rng: rng.randint(32, 768),
    "half 50, half 700": lambda rng: rng.choice([50, 700]),
}


class Batch:
    """num_seqs sequences on shuffled blocks of a cache with room for them to grow (and for the mirror)."""

    def __init__(self, lens: list[int], rng: random.Random, extra: int) -> None:
        self.lens = lens
        per_seq = [-(-(n + extra) // BS) for n in lens]
        num_blocks = 3 * sum(per_seq) + 1  # the mirror's default budget is the layer cache's size
        blocks = list(range(1, num_blocks))
        rng.shuffle(blocks)
        self.tables = [[blocks.pop() for _ in range(n)] for n in per_seq]
        width = max(per_seq)
        self.block_table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        self.caches = [torch.randn(2, num_blocks, BS, KVH, D) for _ in range(2)]

    def meta(self, step: int) -> AttentionMetadata:
        lens = [n + step for n in self.lens]
        slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(self.tables, lens)]
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            block_tables=self.block_table,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
            num_decodes=len(lens),
            max_seq_len=max(lens),
            seq_lens_cpu=lens,
            query_lens_cpu=[1] * len(lens),
            decode_seq_ids=list(range(len(lens))),
        )


def layer_ms(backend: TorchAttention, batch: Batch, steps: int) -> float:
    times = []
    n = len(batch.lens)
    for step in range(steps + 5):
        meta = batch.meta(step)
        q, k, v = torch.randn(n, H, D), torch.randn(n, KVH, D), torch.randn(n, KVH, D)
        backend.forward(q, k, v, batch.caches[0], meta)  # the step's first layer: builds the plan
        start = time.perf_counter()
        backend.forward(q, k, v, batch.caches[1], meta)
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:]) * 1e3


def plan_us(batch: Batch, steps: int) -> float:
    mirror, times = DecodeMirror(KVH, D, BS, None), []
    for step in range(steps + 1):
        meta = batch.meta(step)
        start = time.perf_counter()
        mirror.plan(meta, batch.caches[0].nbytes, torch.float32)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batches", default="32,64,256")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    print(f"{'lengths':<20}{'seqs':>6}{'used':>7}{'mirror ms':>11}{'paged ms':>10}{'ratio':>8}{'plan us':>9}")
    for name, draw in CASES.items():
        for n in map(int, a.batches.split(",")):
            rng = random.Random(n)
            batch = Batch([draw(rng) for _ in range(n)], rng, extra=a.steps + 10)
            used = sum(batch.lens) / (n * max(batch.lens))  # of the batch padded to its longest
            mirror = layer_ms(TorchAttention(H, KVH, D, BS), batch, a.steps)
            paged = layer_ms(TorchAttention(H, KVH, D, BS, decode_mirror_bytes=0), batch, a.steps)
            plan = plan_us(batch, a.steps)
            rows.append(
                {"lengths": name, "num_seqs": n, "padded_width_used": used, "mirror_ms": mirror}
                | {"paged_ms": paged, "mirror_over_paged": mirror / paged, "plan_us": plan}
            )
            print(f"{name:<20}{n:>6}{used:>7.2f}{mirror:>11.2f}{paged:>10.2f}{mirror / paged:>8.2f}{plan:>9.0f}")
    if a.json:
        with open(a.json, "w") as f:
            conditions = {"torch_threads": a.threads, "load": os.getloadavg(), "steps": a.steps}
            json.dump({"conditions": conditions, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
