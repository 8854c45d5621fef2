"""What this CPU can do at most for the bundled model: the rates that bound offline throughput.

Times, with --threads torch threads (the offline benchmark's setting):
  matmuls   every linear of one decoder layer and the LM head ([rows, hidden] x weight^T) at
            rows = 1, 8, 32, 64, 512 and 2,048 (decode batches and prefill chunks), as GFLOP/s;
            per rows also the whole model's linears (num_layers layers and the head) in ms per token;
  memory    one read of 1 GiB (a sum) and one copy of 1 GiB, as GB/s: decode attention reads every
            row's K/V once per layer, and a small batch reads every weight once per step.
Medians of --repeats. benchmarks/offline.py reports where (a)'s time went; docs/benchmarks.md
combines the two into the floor of its decode phase.

Usage: python benchmarks/cpu_ceiling.py [--threads 2] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from splitserve.services.model.arch import ModelArchConfig
from splitserve.services.model.loader import open_model

ROWS = (1, 8, 32, 64, 512, 2048)
MEMORY_BYTES = 1 << 30


def seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linears(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of one layer's linears and of the LM head."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return {
        "qkv": (arch.hidden_size, q + 2 * kv),
        "o": (q, arch.hidden_size),
        "gate_up": (arch.hidden_size, 2 * arch.intermediate_size),
        "down": (arch.intermediate_size, arch.hidden_size),
        "lm_head": (arch.hidden_size, arch.vocab_size),
    }


def matmul_table(arch: ModelArchConfig, repeats: int) -> list[dict]:
    rows_out = []
    for rows in ROWS:
        row: dict = {"rows": rows}
        model_s = 0.0
        for name, (fan_in, fan_out) in linears(arch).items():
            x, w = torch.randn(rows, fan_in), torch.randn(fan_out, fan_in)
            s = seconds(lambda x=x, w=w: torch.nn.functional.linear(x, w), repeats)
            row[f"{name}_gflops"] = 2 * rows * fan_in * fan_out / s / 1e9
            model_s += s if name == "lm_head" else s * arch.num_layers
        row["model_linears_ms_per_token"] = model_s / rows * 1e3
        rows_out.append(row)
    return rows_out


def memory_table(repeats: int) -> dict:
    src = torch.ones(MEMORY_BYTES // 4)
    dst = torch.empty_like(src)
    read_s = seconds(lambda: src.sum(), repeats)
    copy_s = seconds(lambda: dst.copy_(src), repeats)
    return {"read_gbps": MEMORY_BYTES / read_s / 1e9, "copy_gbps": MEMORY_BYTES / copy_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    arch = open_model(None).arch
    report = {
        "conditions": {"torch_threads": args.threads, "repeats": args.repeats, "load_before": os.getloadavg()},
        "matmuls": matmul_table(arch, args.repeats),
        "memory": memory_table(args.repeats),
    }
    report["conditions"]["load_after"] = os.getloadavg()
    names = list(linears(arch))
    print(f"Linears of {arch.architecture} (fp32, {args.threads} threads), GFLOP/s; whole model's linears, ms/token")
    print(f"{'rows':>6}" + "".join(f"{n:>10}" for n in names) + f"{'ms/token':>10}")
    for row in report["matmuls"]:
        rates = "".join(f"{row[f'{n}_gflops']:>10.1f}" for n in names)
        print(f"{row['rows']:>6}{rates}{row['model_linears_ms_per_token']:>10.2f}")
    memory = report["memory"]
    print(f"memory: read {memory['read_gbps']:.1f} GB/s, copy {memory['copy_gbps']:.1f} GB/s (1 GiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
