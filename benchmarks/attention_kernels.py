"""GPU benchmark of the Triton kernels (splitserve.kernels) against their torch counterparts, bf16.

Table 1, paged decode attention: one query token per sequence, batch 1/16/64/256 x context
512/4k/32k, block size 16. Triton kernel (split-K count from its heuristic) against the torch
backend's forward on the same batch. Reports achieved bandwidth = K/V bytes read / kernel time and
its share of the GPU's peak HBM bandwidth. Target: >= 60% of peak at batch 64, 4k context.
Table 2, paged prefill attention: whole prompts (no prefix) and 512-token chunks after a prefix of
context - 512 tokens, same grid; TFLOP/s counts the causal half only (4 * heads * head_dim per
visible query-key pair). Configurations past --max-prefill-tokens query tokens are skipped.
Table 3, store_kv / rms_norm (plain and fused residual) / rotary_embedding / silu_and_mul against
their torch `*_ref`, at 64 and 4096 tokens.
Table 4, end-to-end decode step of SmolLM2-135M-Instruct (bf16) with each attention backend: ms per
engine.step() and per bare model forward (synchronized: the time until its kernels finished), after
all requests reached the decode phase.

Attention shapes are one layer of a Llama-3-8B-like model (32 query heads, 8 KV heads, head_dim
128) unless --shape smollm2 (9, 3, 64). Times are medians of triton.testing.do_bench (L2 flushed
between runs). The torch attention baseline is skipped when its K/V gather would not fit
(--max-torch-kv-gib).

Usage: python benchmarks/attention_kernels.py [--shape llama3-8b|smollm2] [--batches 1,64] [--contexts 4096]
       [--json PATH]   (needs CUDA)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # num_heads, num_kv_heads, head_dim
INTERMEDIATE = {"llama3-8b": 14336, "smollm2": 1536}
BATCHES = (1, 16, 64, 256)
CONTEXTS = (512, 4096, 32768)
BLOCK_SIZE = 16
CHUNK = 512
DTYPE = torch.bfloat16


def require_cuda() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit(
            "benchmarks/attention_kernels.py: unset TRITON_INTERPRET (the interpreter is for CPU tests, not timing)"
        )
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/attention_kernels.py needs a CUDA GPU (torch sees none); the kernels' CPU tests are "
            "`python -m pytest tests/unit/kernels/test_kernels.py` under the Triton interpreter"
        )


def peak_hbm_gbps(override: float | None) -> float | None:
    """From the device's memory clock and bus width (double data rate), when torch reports them."""
    if override:
        return override
    props = torch.cuda.get_device_properties(0)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100)


# -- paged batches ------------------------------------------------------------------------------------
def paged_batch(shape, seq_lens: list[int], query_lens: list[int]):
    """Random K/V for every context token in shuffled blocks, queries, and the metadata of one step
    (its new tokens already in the cache: their slots are rewritten with the same values)."""
    from splitserve.services.model.attention import AttentionMetadata

    num_heads, num_kv_heads, head_dim = shape
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    order = torch.randperm(sum(blocks), device="cuda")  # scattered blocks, as after a while of serving
    kv_cache = torch.empty(2, sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device="cuda").normal_()
    width = max(blocks)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int64, device="cuda")
    start = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[start : start + n]
        start += n
    slots = torch.cat([_slots(table[i], s - q, s) for i, (s, q) in enumerate(zip(seq_lens, query_lens))])
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        query_start_loc=qsl.cuda(),
        num_decodes=len(query_lens) if max(query_lens) == 1 else 0,
        max_seq_len=max(seq_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    q = torch.randn(sum(query_lens), num_heads, head_dim, dtype=DTYPE, device="cuda")
    k_new = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots]
    v_new = kv_cache[1].view(-1, num_kv_heads, head_dim)[slots]
    return q, k_new, v_new, kv_cache, meta


def _slots(table_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    pos = torch.arange(start, end, device="cuda")
    return table_row[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def kv_gib(shape, batch: int, context: int) -> float:
    return 2 * batch * context * shape[1] * shape[2] * DTYPE.itemsize / 1024**3


def torch_baseline(shape, q, k, v, kv_cache, meta, triton_out, limit_gib: float) -> dict:
    """The torch backend's forward on the same step: ms, and its largest difference from triton_out."""
    from splitserve.services.model.attention.torch_backend import TorchAttention

    if 2 * kv_cache.numel() * DTYPE.itemsize / 1024**3 > limit_gib:  # the gather copies the context
        return {"torch_ms": None, "max_abs_diff": None}
    backend = TorchAttention(*shape, BLOCK_SIZE)
    diff = (backend.forward(q, k, v, kv_cache, meta).float() - triton_out.float()).abs().max().item()
    return {"torch_ms": bench_ms(lambda: backend.forward(q, k, v, kv_cache, meta)), "max_abs_diff": diff}


def decode_table(shape, peak_gbps, args) -> list[dict]:
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            if kv_gib(shape, batch, context) > args.max_kv_gib:
                rows.append({"batch": batch, "context": context, "skipped": "KV over --max-kv-gib"})
                continue
            rows.append(_decode_row(shape, batch, context, peak_gbps, args))
            torch.cuda.empty_cache()  # the batch's tensors died with _decode_row's frame
    return rows


def _decode_row(shape, batch: int, context: int, peak_gbps, args) -> dict:
    from splitserve.kernels import paged_decode_attention
    from splitserve.kernels.paged_decode import choose_num_splits, sm_count

    q, k, v, kv_cache, meta = paged_batch(shape, [context] * batch, [1] * batch)
    scale = shape[2] ** -0.5

    def run():
        return paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, max_seq_len=context)

    ms = bench_ms(run)
    kv_bytes = 2 * batch * context * shape[1] * shape[2] * DTYPE.itemsize
    gbps = kv_bytes / ms / 1e6
    return {
        "batch": batch,
        "context": context,
        "triton_ms": ms,
        "gbps": gbps,
        "peak_pct": 100 * gbps / peak_gbps if peak_gbps else None,
        "num_splits": choose_num_splits(batch, shape[1], context, sm_count(q.device)),
        **torch_baseline(shape, q, k, v, kv_cache, meta, run(), args.max_torch_kv_gib),
    }


def causal_flops(shape, prefix: int, query_len: int) -> float:
    visible = query_len * prefix + query_len * (query_len + 1) / 2
    return 4 * shape[0] * shape[2] * visible


def prefill_table(shape, args) -> list[dict]:
    rows = []
    for mode in ("full", "chunk"):
        for context in args.contexts:
            for batch in args.batches:
                query_len = context if mode == "full" else min(CHUNK, context)
                row = {"mode": mode, "batch": batch, "context": context, "query_len": query_len}
                if batch * query_len > args.max_prefill_tokens or kv_gib(shape, batch, context) > args.max_kv_gib:
                    rows.append({**row, "skipped": "over --max-prefill-tokens / --max-kv-gib"})
                    continue
                rows.append({**row, **_prefill_timing(shape, batch, context, query_len, args)})
                torch.cuda.empty_cache()  # the batch's tensors died with _prefill_timing's frame
    return rows


def _prefill_timing(shape, batch: int, context: int, query_len: int, args) -> dict:
    from splitserve.kernels import paged_prefill_attention

    q, k, v, kv_cache, meta = paged_batch(shape, [context] * batch, [query_len] * batch)
    run = lambda: paged_prefill_attention(  # noqa: E731
        q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, shape[2] ** -0.5, max_query_len=query_len
    )
    ms = bench_ms(run)
    flops = batch * causal_flops(shape, context - query_len, query_len)
    return {
        "triton_ms": ms,
        "tflops": flops / ms / 1e9,
        **torch_baseline(shape, q, k, v, kv_cache, meta, run(), args.max_torch_kv_gib),
    }


# -- elementwise kernels -------------------------------------------------------------------------------
def ops_table(shape, intermediate: int) -> list[dict]:
    import splitserve.kernels as K

    num_heads, num_kv_heads, head_dim = shape
    hidden = num_heads * head_dim
    rows = []
    for tokens in (64, 4096):
        x = torch.randn(tokens, hidden, dtype=DTYPE, device="cuda")
        residual = torch.randn_like(x)
        weight = torch.ones(hidden, dtype=DTYPE, device="cuda")
        gate_up = torch.randn(tokens, 2 * intermediate, dtype=DTYPE, device="cuda")
        q = torch.randn(tokens, num_heads, head_dim, dtype=DTYPE, device="cuda")
        k = torch.randn(tokens, num_kv_heads, head_dim, dtype=DTYPE, device="cuda")
        cos, sin = K.rope_cos_sin(1.0 / 500000 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim), 8192)
        positions = torch.randint(0, 8192, (tokens,), device="cuda")
        cache = torch.empty(2, tokens // BLOCK_SIZE + 1, BLOCK_SIZE, num_kv_heads, head_dim, dtype=DTYPE, device="cuda")
        slots = torch.randperm(tokens, device="cuda")
        cases = {
            "store_kv": (K.store_kv, K.store_kv_ref, (k, k, cache, slots)),
            "rms_norm": (K.rms_norm, K.rms_norm_ref, (x, weight, 1e-5)),
            "rms_norm+residual": (K.rms_norm, K.rms_norm_ref, (x, weight, 1e-5, residual)),
            "rotary_embedding": (K.rotary_embedding, K.rotary_embedding_ref, (positions, q, k, cos, sin)),
            "silu_and_mul": (K.silu_and_mul, K.silu_and_mul_ref, (gate_up,)),
        }
        for name, (kernel, ref, call_args) in cases.items():
            rows.append(
                {
                    "op": name,
                    "tokens": tokens,
                    "triton_us": 1e3 * bench_ms(lambda: kernel(*call_args)),
                    "torch_us": 1e3 * bench_ms(lambda: ref(*call_args)),
                }
            )
    return rows


# -- end to end ----------------------------------------------------------------------------------------
def _synchronized(fn):
    """fn, then a CUDA synchronize: decode_step_ms (experiments/offline.py) reads the clock right after
    runner.forward, which on a GPU only queues the kernels. (engine.step syncs anyway: it samples on
    the host.)"""

    def run(*args):
        out = fn(*args)
        torch.cuda.synchronize()
        return out

    return run


def e2e_table(args) -> list[dict]:
    from splitserve.experiments.offline import decode_step_ms
    from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.services.engine.llm import LLM

    rows = []
    for backend in ("torch", "triton"):
        llm = LLM(
            EngineConfig(
                dtype="bfloat16",
                device="cuda",
                attention_backend=backend,
                cache=CacheConfig(kv_cache_bytes=args.e2e_kv_gib * 1024**3),
                scheduler=SchedulerConfig(max_num_seqs=max(args.batches), max_num_batched_tokens=8192),
            )
        )
        runner = llm.engine.runner
        runner.forward = _synchronized(runner.forward)
        for batch in args.batches:
            step_ms, forward_ms = decode_step_ms(llm, batch, args.e2e_context, num_steps=20)
            rows.append(
                {
                    "backend": backend,
                    "batch": batch,
                    "context": args.e2e_context,
                    "step_ms": step_ms,
                    "forward_ms": forward_ms,
                }
            )
        del llm
        torch.cuda.empty_cache()
    return rows


# -- printing ------------------------------------------------------------------------------------------
def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(decode, prefill, ops, e2e, shape, peak_gbps) -> None:
    print(
        f"\n{torch.cuda.get_device_name(0)}, peak HBM {_fmt(peak_gbps, '.0f')} GB/s, bf16, "
        f"heads/kv_heads/head_dim {shape}, block size {BLOCK_SIZE}"
    )
    print("\nPaged decode attention")
    print(
        f"{'batch':>6}{'context':>9}{'splits':>7}{'triton ms':>11}{'GB/s':>9}{'% peak':>8}{'torch ms':>10}"
        f"{'max diff':>10}"
    )
    for r in decode:
        if "skipped" in r:
            print(f"{r['batch']:>6}{r['context']:>9}  skipped: {r['skipped']}")
            continue
        print(
            f"{r['batch']:>6}{r['context']:>9}{r['num_splits']:>7}{r['triton_ms']:>11.3f}{r['gbps']:>9.0f}"
            f"{_fmt(r['peak_pct'], '.1f'):>8}{_fmt(r['torch_ms'], '.3f'):>10}{_fmt(r['max_abs_diff'], '.1e'):>10}"
        )
    print("\nPaged prefill attention (causal FLOPs)")
    print(
        f"{'mode':>6}{'batch':>6}{'context':>9}{'query':>7}{'triton ms':>11}{'TFLOP/s':>9}{'torch ms':>10}"
        f"{'max diff':>10}"
    )
    for r in prefill:
        head = f"{r['mode']:>6}{r['batch']:>6}{r['context']:>9}{r['query_len']:>7}"
        if "skipped" in r:
            print(f"{head}  skipped: {r['skipped']}")
            continue
        print(
            f"{head}{r['triton_ms']:>11.3f}{r['tflops']:>9.1f}{_fmt(r['torch_ms'], '.3f'):>10}"
            f"{_fmt(r['max_abs_diff'], '.1e'):>10}"
        )
    print("\nElementwise kernels")
    print(f"{'op':<20}{'tokens':>7}{'triton us':>11}{'torch us':>10}")
    for r in ops:
        print(f"{r['op']:<20}{r['tokens']:>7}{r['triton_us']:>11.1f}{r['torch_us']:>10.1f}")
    print("\nEnd-to-end decode step, SmolLM2-135M-Instruct bf16")
    print(f"{'backend':<8}{'batch':>6}{'context':>9}{'step ms':>9}{'forward ms':>12}")
    for r in e2e:
        print(f"{r['backend']:<8}{r['batch']:>6}{r['context']:>9}{r['step_ms']:>9.2f}{r['forward_ms']:>12.2f}")


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--batches", type=_int_list, default=BATCHES, help="comma-separated batch sizes")
    parser.add_argument("--contexts", type=_int_list, default=CONTEXTS, help="comma-separated context lengths")
    parser.add_argument("--peak-gbps", type=float, help="peak HBM bandwidth, if torch does not report it")
    parser.add_argument("--max-kv-gib", type=float, default=48.0)
    parser.add_argument("--max-torch-kv-gib", type=float, default=8.0)
    parser.add_argument("--max-prefill-tokens", type=int, default=256 * 1024)
    parser.add_argument("--e2e-context", type=int, default=1024)
    parser.add_argument("--e2e-kv-gib", type=int, default=16)
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args()
    require_cuda()
    torch.manual_seed(0)
    shape = SHAPES[args.shape]
    peak = peak_hbm_gbps(args.peak_gbps)
    decode, prefill = decode_table(shape, peak, args), prefill_table(shape, args)
    ops = ops_table(shape, INTERMEDIATE[args.shape])
    e2e = [] if args.skip_e2e else e2e_table(args)
    print_tables(decode, prefill, ops, e2e, shape, peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(0),
                    "shape": shape,
                    "peak_gbps": peak,
                    "decode": decode,
                    "prefill": prefill,
                    "ops": ops,
                    "e2e": e2e,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
