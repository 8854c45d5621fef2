"""Tensor parallelism inside a worker (services/engine/ranks.py): decode step time at N ranks, and the KV handoff
between tiers of equal and of mismatched sizes (prints numbers).

The model: the bundled SmolLM2-135M has 9 query and 3 KV heads, which split over 1 or 3 ranks only. So
by default (`--model smollm2-8h`) this writes a Llama of SmolLM2's shape with its heads regrouped to
split over 1, 2 and 4: SmolLM2's tokenizer, vocab (49152, tied embeddings), 30 layers and intermediate
size 1536, with hidden size 512 = 8 query heads and 4 KV heads of 64 (119M parameters against SmolLM2's
135M), random weights (timing does not depend on them). `--model PATH` takes any HF folder or .gguf
(`--model bundled`: SmolLM2 itself, then `--sizes 1,3`); a size the model cannot take is refused up front.

decode: one Engine per size N in this process (rank 0 here, N - 1 follower processes), B requests of
    --context random tokens (greedy, ignore_eos) in steady decode: every timed step decodes one token
    of each of the B requests. Wall time per Engine.step() (median, p90, mean over --steps, after
    --warm-up steps); on CPU in float32 with --threads torch threads split evenly over the ranks (one
    each on 2 cores at N = 2, so both sizes use the same cores); on CUDA in bfloat16, rank r on cuda:r.
handoff: a real 1P1D cluster (launch.launcher.start_cluster) per (prefill ranks, decode ranks) pair,
    --requests sequential requests of --prompt-len distinct random tokens and max_tokens=2 (the second
    token is the decode worker's, after the KV landed), after one warm-up request (it sets up the KV
    channel). Per pair: bytes per handoff and three times, ms:
      stage     the response's timings.stages.kv_transfer_ms (the gateway's request_stage_seconds
                {stage="kv_transfer"}): from the first token at the decode worker to the KV in the cache
                of every decode rank, the whole handoff after the first token; mean, p50, p90;
      received  the decode worker's splitserve_kv_transfer_seconds{direction="received"}: its own
                measure of the transfer (the slowest rank's piece, since rank-to-rank handoffs), mean
                = _sum / _count;
      sent      the prefill worker's {direction="sent"}, mean.
    Workers get the cores split evenly over all ranks (launcher.threads_per_worker).

Both record the machine: CPU, cores, torch, the 1-minute load average and the busiest other processes
before and after (what else ran).

Usage: python benchmarks/tensor_parallel.py [all|decode|handoff] [--sizes 1,2] [--batches 1,8,32]
       [--pairs 1x1,2x2,2x1,1x2] [--requests 6 --prompt-len 512] [--json runs/tensor_parallel.json]
GPU, bf16, one GPU per rank (workers that share a GPU take 0.4 of it each):
       4+ GPUs: python benchmarks/tensor_parallel.py --device cuda --sizes 1,2,4 --batches 1,32,128
       2 GPUs:  python benchmarks/tensor_parallel.py --device cuda --batches 1,32,128 --pairs 1x1,2x1,1x2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from cluster_helpers import greedy_request, metric, stub  # noqa: E402

from splitserve.common.sampling_params import SamplingParams  # noqa: E402
from splitserve.common.tokenizer import load_tokenizer  # noqa: E402
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from splitserve.services.engine.engine import Engine  # noqa: E402
from splitserve.services.model.loader import open_model  # noqa: E402
from splitserve.services.model.parallel import possible_sizes  # noqa: E402

DEFAULT_MODEL = "smollm2-8h"
SEED = 0
FIRST_ID = 100  # random prompt tokens from here up: no special tokens
HANDOFF_BLOCK_SIZE = 16


# -- the model ---------------------------------------------------------------------------------------
def write_smollm2_8h(folder: Path) -> Path:
    """SmolLM2-135M's shape and tokenizer with 8 query / 4 KV heads of 64 (splits over 1, 2, 4 ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = load_tokenizer(None)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        eos_token_id=min(tokenizer.eos_token_ids),
        bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    return folder


def resolve_model(name: str, tmp: Path) -> str | None:
    if name == DEFAULT_MODEL:
        return str(write_smollm2_8h(tmp / DEFAULT_MODEL))
    return None if name == "bundled" else name


def check_sizes(model: str | None, sizes: set[int]) -> None:
    """Refuse, before anything starts, sizes the model cannot be split over."""
    can = possible_sizes(open_model(model).arch)
    bad = sorted(s for s in sizes if s not in can)
    if bad:
        raise SystemExit(f"{model or 'the bundled SmolLM2'} cannot be split over {bad} ranks; sizes that can: {can}")


# -- decode step time --------------------------------------------------------------------------------
def make_engine(model: str | None, size: int, a: argparse.Namespace) -> Engine:
    max_len = a.context + a.warm_up + a.steps + 16
    max_batch = max(a.batches)
    arch = open_model(model).arch
    token_bytes = arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * (4 if a.device == "cpu" else 2)
    config = EngineConfig(
        model=model,
        dtype="float32" if a.device == "cpu" else "bfloat16",
        device=a.device,
        tensor_parallel_size=size,
        max_model_len=max_len,
        seed=SEED,
        cache=CacheConfig(kv_cache_bytes=int(1.25 * (max_batch + 1) * (max_len + 16) * token_bytes)),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch)),
    )
    engine = Engine(config)
    if a.device != "cpu":
        engine.warm_up()  # compile every kernel variant first, as a server does
    return engine


def percentiles(times_ms: list[float]) -> dict[str, float]:
    ordered = sorted(times_ms)
    return {
        "median_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ID, vocab) for _ in range(length)] for _ in range(num)]


def decode_step_times(engine: Engine, batch: int, a: argparse.Namespace) -> dict[str, float]:
    """ms per step once all batch requests decode (one token each per step); the requests are aborted after."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=a.warm_up + a.steps + 8)
    prompts = random_prompts(batch, a.context, engine.vocab_size, SEED + batch)
    ids = [engine.add_request(p, params) for p in prompts]
    for _ in range(64):  # chunked prefill: the first step that gives every request a token ends it
        if len(engine.step()) == batch:
            break
    else:
        raise RuntimeError(f"batch {batch}: the prompts were not prefilled within 64 steps")
    for _ in range(a.warm_up):
        engine.step()
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        outputs = engine.step()
        times.append((time.perf_counter() - start) * 1e3)
        if len(outputs) != batch:
            raise RuntimeError(f"a timed step produced {len(outputs)} outputs, expected {batch}")
    for request_id in ids:
        engine.abort_request(request_id)
    return percentiles(times)


def measure_decode(model: str | None, a: argparse.Namespace) -> list[dict]:
    rows = []
    for size in a.sizes:
        if a.device == "cpu":
            torch.set_num_threads(max(1, a.threads // size))  # followers take rank 0's count
        start = time.perf_counter()
        engine = make_engine(model, size, a)
        started_s = time.perf_counter() - start
        try:
            for batch in a.batches:
                row = {"size": size, "batch": batch, "threads_per_rank": torch.get_num_threads()}
                rows.append(row | {"engine_start_s": round(started_s, 1)} | decode_step_times(engine, batch, a))
        finally:
            engine.close()
    return rows


def print_decode(rows: list[dict], a: argparse.Namespace) -> None:
    sizes = sorted({r["size"] for r in rows})
    by = {(r["size"], r["batch"]): r for r in rows}
    print(f"\ndecode step, ms (wall), {a.context}-token prompts, {a.steps} steps after {a.warm_up}; device {a.device}")
    columns = ["batch"] + [f"N={n} {stat}" for n in sizes for stat in ("median", "p90")]
    columns += [f"N={n}/N={sizes[0]}" for n in sizes[1:]]  # ratios of the medians
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for batch in a.batches:
        cells = [str(batch)] + [f"{by[n, batch][k]:.1f}" for n in sizes for k in ("median_ms", "p90_ms")]
        base = by[sizes[0], batch]["median_ms"]
        cells += [f"{by[n, batch]['median_ms'] / base:.2f}x" for n in sizes[1:]]
        print("| " + " | ".join(cells) + " |")
    threads = ", ".join(f"N={n}: {by[n, a.batches[0]]['threads_per_rank']}" for n in sizes)
    print(f"torch threads per rank: {threads}")


# -- handoff -----------------------------------------------------------------------------------------
def cluster_argv(model: str | None, a: argparse.Namespace) -> list[str]:
    argv = ["--kv-cache-bytes", str(a.handoff_kv_bytes), "--block-size", str(HANDOFF_BLOCK_SIZE)]
    argv += ["--max-model-len", str(a.prompt_len + 64), "--device", a.device]
    argv += ["--dtype", "float32" if a.device == "cpu" else "bfloat16"]
    return (["--model", model] if model else []) + argv


def start_pair(model: str | None, prefill_tp: int, decode_tp: int, a: argparse.Namespace) -> list:
    """A 1P1D cluster; started a second time if a process exits or stalls while starting (on a shared
    machine another process can take a port between free_port and the bind)."""
    from splitserve.services.launcher.launcher import parse_devices, start_cluster

    for attempt in (1, 2):
        try:
            return start_cluster(
                0,
                cluster_argv(model, a),
                num_prefill=1,
                num_decode=1,
                tp_sizes={"prefill": prefill_tp, "decode": decode_tp},
                devices=parse_devices("cuda") if a.device == "cuda" else None,
                worker_argv=["--gpu-memory-fraction", "0.4"] if a.device == "cuda" else None,
                http_port=None,
            )
        except (RuntimeError, TimeoutError) as e:
            if attempt == 2:
                raise
            print(f"the {prefill_tp}x{decode_tp} cluster did not start ({e}); starting it again", flush=True)


def handoff_pair(model: str | None, prefill_tp: int, decode_tp: int, a: argparse.Namespace, vocab: int) -> dict:
    from splitserve.services.launcher.launcher import stop_cluster

    start = time.perf_counter()
    children = start_pair(model, prefill_tp, decode_tp, a)
    try:
        gateway, prefill, decode = children
        started_s = time.perf_counter() - start
        s = stub(gateway.address)
        prompts = random_prompts(a.requests + 1, a.prompt_len, vocab, SEED + 100 * prefill_tp + decode_tp)
        list(s.Generate(greedy_request(prompts[0], 2), timeout=300))  # warm-up: sets up the KV channel
        before = transfer_counters(prefill.metrics, decode.metrics)
        stages = [stage_ms(s, p) for p in prompts[1:]]
        after = transfer_counters(prefill.metrics, decode.metrics)
    finally:
        stop_cluster(children)
    delta = {k: after[k] - before[k] for k in after}
    return summarize(prefill_tp, decode_tp, stages, delta, started_s)


def stage_ms(s, prompt: list[int]) -> float:
    chunks = list(s.Generate(greedy_request(prompt, 2), timeout=300))
    if sum(len(c.token_ids) for c in chunks) != 2:
        raise RuntimeError("a handoff request did not return its 2 tokens")
    return chunks[-1].timings.stages.kv_transfer_ms


def transfer_counters(prefill_metrics: str, decode_metrics: str) -> dict[str, float]:
    name = "splitserve_kv_transfer"
    return {
        "received_s": metric(decode_metrics, f"{name}_seconds_sum", direction="received"),
        "received": metric(decode_metrics, f"{name}_seconds_count", direction="received"),
        "received_bytes": metric(decode_metrics, f"{name}_bytes_total", direction="received"),
        "sent_s": metric(prefill_metrics, f"{name}_seconds_sum", direction="sent"),
        "sent": metric(prefill_metrics, f"{name}_seconds_count", direction="sent"),
        "recomputed": metric(decode_metrics, f"{name}_recompute_fallbacks_total"),
    }


def summarize(prefill_tp: int, decode_tp: int, stages: list[float], d: dict[str, float], started_s: float) -> dict:
    if d["received"] != len(stages) or d["recomputed"]:
        counts = f"{d['received']:.0f} KV transfers, {d['recomputed']:.0f} prompts recomputed"
        raise RuntimeError(f"{len(stages)} requests but {counts}: the times would not be handoffs'")
    ordered = sorted(stages)
    return {
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "requests": len(stages),
        "cluster_start_s": round(started_s, 1),
        "bytes_per_handoff": d["received_bytes"] / d["received"],
        "stage_mean_ms": round(statistics.fmean(stages), 2),
        "stage_p50_ms": round(statistics.median(stages), 2),
        "stage_p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 2),
        "received_mean_ms": round(1e3 * d["received_s"] / d["received"], 2),
        "sent_mean_ms": round(1e3 * d["sent_s"] / max(1.0, d["sent"]), 2),
        "stage_ms": [round(x, 2) for x in stages],
    }


def print_handoff(rows: list[dict], a: argparse.Namespace) -> None:
    print(f"\nKV handoff, 1P1D, {a.prompt_len}-token prompts, max_tokens=2, ms; device {a.device}")
    columns = ["prefill N", "decode N", "requests", "MiB/handoff", "stage mean", "stage p50", "stage p90"]
    columns += ["received mean", "sent mean"]
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for r in rows:
        print(
            f"| {r['prefill_tp']} | {r['decode_tp']} | {r['requests']} | {r['bytes_per_handoff'] / 2**20:.2f} "
            f"| {r['stage_mean_ms']:.1f} | {r['stage_p50_ms']:.1f} | {r['stage_p90_ms']:.1f} "
            f"| {r['received_mean_ms']:.1f} | {r['sent_mean_ms']:.1f} |"
        )


# -- the machine -------------------------------------------------------------------------------------
def busiest_processes(count: int = 6) -> list[str]:
    """The processes using the most CPU (ps's lifetime average), this benchmark's own included."""
    out = subprocess.run(
        ["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True, check=False
    ).stdout
    return [line[:140] for line in out.splitlines()[1 : count + 1]]


def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}
    cpuinfo = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
    info["cpu"] = names[0] if names else platform.processor()
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=["all", "decode", "handoff"], default="all")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{DEFAULT_MODEL} (written here), bundled, or a path")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes", default="1,2", help="decode: tensor-parallel sizes, comma-separated")
    p.add_argument("--batches", default="1,8,32", help="decode: running requests, comma-separated")
    p.add_argument("--context", type=int, default=64, help="decode: prompt tokens per request")
    p.add_argument("--steps", type=int, default=30, help="decode: timed steps per batch")
    p.add_argument("--warm-up", type=int, default=5)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="decode on CPU: torch threads, all ranks")
    p.add_argument("--pairs", default="1x1,2x2,2x1,1x2", help="handoff: PREFILLxDECODE ranks, comma-separated")
    p.add_argument("--requests", type=int, default=6, help="handoff: timed requests per pair")
    p.add_argument("--prompt-len", type=int, default=512, help="handoff: prompt tokens")
    p.add_argument("--handoff-kv-bytes", type=int, default=256 * 1024**2, help="handoff: --kv-cache-bytes per rank")
    p.add_argument("--json", "--out", metavar="PATH", default="runs/tensor_parallel.json")
    a = p.parse_args()
    a.sizes = [int(s) for s in a.sizes.split(",")]
    a.batches = [int(b) for b in a.batches.split(",")]
    a.pairs = [tuple(int(n) for n in pair.split("x")) for pair in a.pairs.split(",")]
    return a


def main() -> None:
    a = parse_args()
    before = {"load_1m": round(os.getloadavg()[0], 2), "busiest": busiest_processes()}
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model(a.model, Path(tmp))
        sizes = set(a.sizes) if a.what != "handoff" else set()
        check_sizes(model, sizes | ({n for pair in a.pairs for n in pair} if a.what != "decode" else set()))
        if a.what in ("all", "decode"):
            results["decode"] = measure_decode(model, a)
            print_decode(results["decode"], a)
        if a.what in ("all", "handoff"):
            vocab = open_model(model).arch.vocab_size
            results["handoff"] = [handoff_pair(model, p, d, a, vocab) for p, d in a.pairs]
            print_handoff(results["handoff"], a)
    after = {"load_1m": round(os.getloadavg()[0], 2), "busiest": busiest_processes()}
    settings = {k: v for k, v in vars(a).items() if k != "json"}
    settings |= {"machine": machine(), "before": before, "after": after}
    print(f"\n1-minute load average before / after: {before['load_1m']} / {after['load_1m']}")
    for when, state in (("before", before), ("after", after)):
        print(f"busiest processes {when} (ps: CPU % over each one's life):")
        print("\n".join(f"  {line}" for line in state["busiest"]))
    path = Path(a.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "results": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
