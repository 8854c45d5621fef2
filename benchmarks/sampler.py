"""Sampler time per step: the per-row reference (the sampler before batching) against the batched
Sampler, in one run, on the same logits and requests.

Batch 32 and 256 x vocabulary 320 (the tests' tiny Llama) and 49152 (SmolLM2), with peaked ("lm")
and flat random logits (see LOGIT_SCALES). The requests cycle through a mix of parameters (greedy;
unseeded with top-p; seeded with top-k; repetition penalty with top-p and min-p; frequency and
presence penalties; min_tokens still blocking EOS), with 128 prompt and 32 output tokens each, no
logprobs. Both sides start from the same shared seed and request seeds, and the table says whether
they sampled the same tokens (on CPU; a CUDA generator draws other numbers). Times are medians over
--repeats calls, after two warm-up calls, of each side in turn (a busy machine slows both alike).

Usage: python benchmarks/sampler.py [--repeats 10] [--threads 2] [--device cpu] [--json runs/sampler.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.request import Request, RequestId
from splitserve.services.engine.sampler import Sampler
from splitserve.services.engine.sampling_ops import RefGenerators, sample_tokens_ref

BATCHES = (32, 256)
VOCABS = (320, 49152)
SEED = 0
# Logits N(0, scale^2): softmax entropy ~ ln(vocab) - scale^2 / 2 nats. "lm" (scale 4, ~2.8 nats at
# 49152, top 1024 tokens ~97% of the mass) is as peaked as a language model's typical next-token
# distribution; "flat" (scale 2, ~8.8 nats) is the worst case for top-p, which must sort whole rows.
LOGIT_SCALES = {"lm": 4.0, "flat": 2.0}
MIX = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=0.7, top_k=50, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
    SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.2, seed=2),
    SamplingParams(temperature=0.6, top_k=20, top_p=0.8, min_tokens=64, max_tokens=200),
)


def make_requests(batch: int, vocab: int) -> list[Request]:
    gen = torch.Generator().manual_seed(batch + vocab)
    requests = []
    for i in range(batch):
        prompt = torch.randint(0, vocab, (128,), generator=gen).tolist()
        params = MIX[i % len(MIX)]
        request = Request(
            RequestId(f"r{i}"), prompt, params, max_tokens=200, eos_token_ids=frozenset({0}), block_size=16
        )
        for token in torch.randint(1, vocab, (32,), generator=gen).tolist():
            request.append_output_token(token)
        requests.append(request)
    return requests


def median_ms(fns: dict, repeats: int, device: torch.device) -> dict[str, float]:
    """Median ms of each function, called in turn (so that a busy machine slows them alike)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats + 2):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t[2:]) for name, t in times.items()}


def measure(batch: int, vocab: int, logits_kind: str, repeats: int, device: torch.device) -> dict:
    requests = make_requests(batch, vocab)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, vocab, generator=gen).mul_(LOGIT_SCALES[logits_kind]).to(device)
    sampler, ref_generators = Sampler(SEED), RefGenerators(SEED)
    same = sampler.sample(logits, requests).token_ids == sample_tokens_ref(logits, requests, ref_generators)
    ms = median_ms(
        {
            "per_row": lambda: sample_tokens_ref(logits, requests, ref_generators),
            "batched": lambda: sampler.sample(logits, requests),
        },
        repeats,
        device,
    )
    return {
        "batch": batch,
        "vocab": vocab,
        "logits": logits_kind,
        "per_row_ms": round(ms["per_row"], 3),
        "batched_ms": round(ms["batched"], 3),
        "speedup": round(ms["per_row"] / ms["batched"], 2),
        "same_tokens_first_step": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", metavar="PATH", default="runs/sampler.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [measure(b, v, kind, args.repeats, device) for v in VOCABS for kind in LOGIT_SCALES for b in BATCHES]
    print(f"sampler ms per step, device {device}, {args.threads} torch threads, median of {args.repeats}")
    print("| batch | vocab | logits | per-row ms | batched ms | speedup | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['vocab']} | {r['logits']} | {r['per_row_ms']:.2f} | {r['batched_ms']:.2f} | "
            f"{r['speedup']:.1f}x | {r['same_tokens_first_step']} |"
        )
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = {"device": str(device), "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__}
    path.write_text(json.dumps({"settings": settings, "results": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
