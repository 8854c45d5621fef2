"""Offline CPU benchmark: splitserve against Hugging Face transformers on SmolLM2-135M (fp32).

Table 1, throughput on one random workload (prompt and output lengths drawn uniformly, fixed seed,
every request generates exactly its output length):
  (a) splitserve LLM.generate on all requests at once (continuous batching);
  (b) transformers generate() in static batches of 8, left padded, in request order. A batch runs
      until its longest output; only each request's own output length counts as useful tokens;
  (c) transformers continuous batching: the manager behind generate_batch, driven directly so each
      request gets its own max_new_tokens; sdpa attention (works on CPU), EOS disabled.
Beside them, splitserve runs the same prompts to their first token only (a cold prefix cache
before and after): at that pass's cost per token, the least time (a) could take for every token it
forwards, measured in the same run; and (a)'s steps split into those with a prompt chunk and the
decode-only ones (the engine's step_stats).
Both engines get a KV cache that holds the whole workload, so neither preempts. Load time and one
short warm-up generate per system are not timed. "same tokens as (a)" counts requests whose greedy
output matches splitserve's token for token (fp32 batching noise and (b)'s padding and EOS masking
may flip a near tie).

Table 2, one decode step at batch B with ~300-token contexts: splitserve engine.step() (schedule,
prepare, forward, sample, update) and its runner.forward() timed inside those steps; the same forward
of an engine with the decode mirror off (its decodes gather their context from the paged cache at
every layer of every step); and transformers' model forward of one token against a DynamicCache of
the same length.

Table 3, prefill: time to the first token of one fresh prompt of 512 and 2,048 random tokens
(LLM.generate with max_tokens=1: schedule, forward, sample), once with the default token budget (one
chunk) and once with a budget of 512 tokens (chunked prefill), against transformers' forward of the
same ids (a DynamicCache built; the logits of the last token only, as generate() asks for on its
prefill, and of every token, as a plain forward returns). Medians over --repeats fresh prompts, the
systems interleaved within each repeat; one more round before them warms up.

Table 4, prefix hit: time to the first token of a fresh 2,048-token prompt (cold), then of a prompt
sharing its first 1,920 tokens (120 blocks of 16 found in the prefix cache) with 128 fresh ones.
Target: cold / hit >= 8x.

Usage: python benchmarks/offline.py [--quick] [--tables throughput,decode,prefill,prefix] [--threads N]
                                    [--repeats N] [--json PATH] [--decode-mirror-bytes N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import asdict

import torch

from splitserve.common.model_files import default_model_path
from splitserve.common.sampling_params import SamplingParams
from splitserve.experiments.offline import FULL, QUICK, Settings, start_decodes, timed, timed_steps
from splitserve.experiments.workload import LengthDist, RequestSpec, WorkloadConfig, make_requests
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.step_stats import StepKind, StepTotals

TABLES = ("throughput", "decode", "prefill", "prefix")
HF_PAGE_SIZE = 256  # transformers' default page size, tokens per KV block
STATIC_BATCH_SIZE = 8
KV_CACHE_BYTES = 3 * 1024**3  # SmolLM2 fp32 KV is 45 KiB/token: ~68k tokens, all 64 requests fit
PREFILL_LENS = (512, 2048)
CHUNK_BUDGET = 512  # the chunked-prefill engine's token budget: a 2,048-token prompt in 4 steps
CHUNKED_KV_CACHE_BYTES = 256 * 1024**2  # ~5.8k tokens: one prompt at a time
PREFIX_PROMPT_LEN, PREFIX_CACHED_LEN = 2048, 1920


def warmup_requests(vocab_size: int) -> list[RequestSpec]:
    return make_requests(
        WorkloadConfig(
            num_requests=2,
            prompt_len=LengthDist("uniform", 16, 24),
            output_len=LengthDist("fixed", 4),
            seed=12345,
            vocab_high=vocab_size,
        )
    )


def output_lens(wl: list[RequestSpec]) -> list[int]:
    return [r.max_tokens for r in wl]


# -- throughput -------------------------------------------------------------------------------------
def run_splitserve(llm: LLM, wl: list[RequestSpec]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens(wl)]
    outputs = [o.token_ids for o in llm.generate([r.prompt_token_ids for r in wl], params)]
    assert [len(o) for o in outputs] == output_lens(wl), "splitserve did not generate exactly max_tokens"
    return outputs


def run_prefill_only(llm: LLM, wl: list[RequestSpec]) -> None:
    """The same prompts to their first token only, from a cold prefix cache (and leaving it cold)."""
    assert llm.engine.kv.pool.reset_prefix_cache(), "blocks still in use"
    llm.generate([r.prompt_token_ids for r in wl], [SamplingParams(temperature=0, max_tokens=1) for _ in wl])
    assert llm.engine.kv.pool.reset_prefix_cache(), "blocks still in use"


def compute_bound(wl: list[RequestSpec], prefill_s: float) -> dict:
    """The least time (a) could take if every token it forwards cost what a token of the batched
    prefill-only pass costs (its large matmuls are this CPU's most efficient forward; a decode token
    runs the same matmuls at a smaller batch and attends over a longer context). (a) forwards every
    prompt token and every output token but each request's last."""
    prompt_tokens = sum(len(r.prompt_token_ids) for r in wl)
    forwarded = prompt_tokens + sum(output_lens(wl)) - len(wl)
    per_token_s = prefill_s / prompt_tokens
    return {"prompt_tokens": prompt_tokens, "forwarded_tokens": forwarded, "seconds": forwarded * per_token_s}


def step_split(before: dict[StepKind, StepTotals], after: dict[StepKind, StepTotals]) -> dict:
    """Where (a)'s steps went: per kind (steps with a prompt chunk, decode-only steps), their number,
    seconds, sequences (decode: rows) and tokens, and the mean context a decode row attends over."""
    split = {}
    for kind in StepKind:
        a, b = after[kind], before[kind]
        split[kind.value] = {
            "steps": a.num_steps - b.num_steps,
            "seconds": a.seconds - b.seconds,
            "seqs": a.num_seqs - b.num_seqs,
            "tokens": a.num_tokens - b.num_tokens,
            "context_tokens": a.context_tokens - b.context_tokens,
        }
    decode = split[StepKind.DECODE.value]
    decode["mean_context"] = decode["context_tokens"] / max(decode["seqs"], 1)
    return split


def run_hf_static(model, wl: list[RequestSpec], pad_id: int) -> list[list[int]]:
    outputs = []
    for i in range(0, len(wl), STATIC_BATCH_SIZE):
        batch = wl[i : i + STATIC_BATCH_SIZE]
        prompts, lens = [r.prompt_token_ids for r in batch], [r.max_tokens for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                pad_token_id=pad_id,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),
            )
        outputs += [row[width : width + n].tolist() for row, n in zip(out, lens)]
    return outputs


def hf_cb_config(wl: list[RequestSpec]):
    from transformers import ContinuousBatchingConfig

    pages = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // HF_PAGE_SIZE) for r in wl)
    # Sized explicitly: on CPU the default takes 60% of host RAM for the cache.
    return ContinuousBatchingConfig(
        page_size=HF_PAGE_SIZE, num_blocks=pages + 4, max_batch_tokens=2048, max_requests_per_batch=64
    )


def run_hf_continuous(model, wl: list[RequestSpec]) -> tuple[list[list[int]], float]:
    """Returns outputs and seconds; the manager's setup (cache allocation) is not timed."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(output_lens(wl)), do_sample=False, eos_token_id=-1)
    cb_config = hf_cb_config(wl)
    with model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=cb_config, block=True, timeout=5
    ) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in wl]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers continuous batching thread stopped early")
        seconds = time.perf_counter() - start
    outputs = [list(results[i].generated_tokens) for i in ids]
    assert [len(o) for o in outputs] == output_lens(wl), "transformers CB did not generate exactly max_new_tokens"
    return outputs, seconds


def num_identical(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


# -- decode step ------------------------------------------------------------------------------------
class HFDecodes:
    """transformers' side of the decode table: batch_size sequences over a DynamicCache that starts at
    decode_context tokens and grows by one per forward, as the engine's contexts do."""

    def __init__(self, model, batch_size: int, context: int) -> None:
        from transformers import DynamicCache

        cfg = model.config
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        self.model, self.cache = model, DynamicCache(config=cfg)
        shape = (batch_size, cfg.num_key_value_heads, context, head_dim)
        for layer in range(cfg.num_hidden_layers):  # decode cost does not depend on the cached values
            self.cache.update(torch.randn(shape), torch.randn(shape), layer)
        self.ids = torch.randint(WorkloadConfig().vocab_low, cfg.vocab_size, (batch_size, 1))  # no special tokens
        self.batch_size, self.context = batch_size, context
        self.forward_s(1)  # warm-up

    @torch.inference_mode()
    def forward_s(self, num_steps: int) -> list[float]:
        seconds = []
        for _ in range(num_steps):
            mask = torch.ones(self.batch_size, self.context + 1, dtype=torch.long)
            positions = torch.full((self.batch_size, 1), self.context)
            seconds.append(
                timed(
                    self.model,
                    input_ids=self.ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=self.cache,
                    use_cache=True,
                )[1]
            )
            self.context += 1
        return seconds


# -- prefill and prefix hits ------------------------------------------------------------------------
def random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(WorkloadConfig().vocab_low, vocab_size) for _ in range(n)]


def ttft_s(llm: LLM, ids: list[int]) -> tuple[float, int]:
    """(seconds to generate one token for prompt ids, prompt tokens found in the prefix cache)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    (out,), seconds = timed(llm.generate, [ids], params)
    return seconds, out.num_cached_tokens


@torch.inference_mode()
def hf_prefill_s(model, ids: list[int], logits_to_keep: int) -> float:
    """Seconds for transformers' forward of ids into a new cache; logits_to_keep 0: every token's logits."""
    start = time.perf_counter()
    model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=logits_to_keep)
    return time.perf_counter() - start


def prefill_table(llms: dict[str, LLM], model, repeats: int, vocab_size: int) -> list[dict]:
    rng = random.Random(7)
    rows = []
    for n in PREFILL_LENS:
        samples: dict[str, list[float]] = {}
        for r in range(repeats + 1):  # round 0 warms up
            ids = random_ids(rng, n, vocab_size)  # fresh: no prefix hit
            times = {name: ttft_s(llm, ids)[0] for name, llm in llms.items()}
            times["hf_last_logits"] = hf_prefill_s(model, ids, 1)
            times["hf_all_logits"] = hf_prefill_s(model, ids, 0)
            for name, seconds in times.items() if r else ():
                samples.setdefault(name, []).append(seconds)
        row: dict = {"prompt_tokens": n, "samples_s": samples}
        row |= {f"{name}_s": statistics.median(v) for name, v in samples.items()}
        for name in llms:
            row[f"{name}_over_hf_last"] = row[f"{name}_s"] / row["hf_last_logits_s"]
            row[f"{name}_over_hf_all"] = row[f"{name}_s"] / row["hf_all_logits_s"]
        rows.append(row)
    return rows


def prefix_table(llm: LLM, repeats: int, vocab_size: int) -> dict:
    rng = random.Random(11)
    cold, hit = [], []
    for r in range(repeats + 1):  # round 0 warms up
        ids = random_ids(rng, PREFIX_PROMPT_LEN, vocab_size)
        cold_s, cold_cached = ttft_s(llm, ids)
        tail = random_ids(rng, PREFIX_PROMPT_LEN - PREFIX_CACHED_LEN, vocab_size)
        hit_s, hit_cached = ttft_s(llm, ids[:PREFIX_CACHED_LEN] + tail)
        assert (cold_cached, hit_cached) == (0, PREFIX_CACHED_LEN), f"cached {cold_cached} / {hit_cached} tokens"
        if r:
            cold.append(cold_s)
            hit.append(hit_s)
    cold_med, hit_med = statistics.median(cold), statistics.median(hit)
    return {
        "prompt_tokens": PREFIX_PROMPT_LEN,
        "cached_tokens": PREFIX_CACHED_LEN,
        "cold_s": cold_med,
        "hit_s": hit_med,
        "cold_over_hit": cold_med / hit_med,
        "samples_s": {"cold": cold, "hit": hit},
    }


# -- main -------------------------------------------------------------------------------------------
def load_hf():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def throughput_table(llm: LLM, model, wl: list[RequestSpec], vocab_size: int) -> dict:
    warm = warmup_requests(vocab_size)
    pad_id = model.generation_config.eos_token_id
    pad_id = pad_id[0] if isinstance(pad_id, list) else pad_id
    run_splitserve(llm, warm)
    _, sec_p = timed(run_prefill_only, llm, wl)
    before = llm.engine.step_stats.snapshot()
    out_a, sec_a = timed(run_splitserve, llm, wl)
    steps_a = step_split(before, llm.engine.step_stats.snapshot())
    run_hf_static(model, warm, pad_id)
    out_b, sec_b = timed(run_hf_static, model, wl, pad_id)
    rows = {"a_splitserve": (sec_a, out_a), "b_hf_static8": (sec_b, out_b)}
    try:
        run_hf_continuous(model, warm)
        out_c, sec_c = run_hf_continuous(model, wl)
        rows["c_hf_continuous"] = (sec_c, out_c)
    except Exception as e:  # report and go on: (c) is optional on CPU
        print(f"(c) transformers continuous batching failed on CPU: {type(e).__name__}: {e}")
    n = sum(output_lens(wl))
    result = {
        name: {"seconds": sec, "useful_tokens": n, "tokens_per_s": n / sec, "identical_to_a": num_identical(out, out_a)}
        for name, (sec, out) in rows.items()
    }
    result["prefill_only_s"] = sec_p
    result["a_steps"] = steps_a
    result["compute_bound"] = bound = compute_bound(wl, sec_p)
    for name in ("b_hf_static8", "c_hf_continuous"):
        if name in result:
            result[f"ratio_a_over_{name[0]}"] = result["a_splitserve"]["tokens_per_s"] / result[name]["tokens_per_s"]
            result[f"bound_over_{name[0]}"] = result[name]["seconds"] / bound["seconds"]
    return result


def decode_table(llm: LLM, model, s: Settings, rounds: int = 4) -> list[dict]:
    """Per batch, medians of per-step times: splitserve's engine.step() and its forward (its decodes
    attending over their mirrored K/V, the CPU default); the forward of the same engine gathering from
    the paged cache instead (decode mirror off); transformers' forward. The three take turns, rounds
    times decode_steps / rounds steps each in a rotating order, so drift on a shared machine falls on
    all of them; every context starts at decode_context tokens and grows one per step."""
    paged = LLM(engine_config(decode_mirror_bytes=0))
    per_round = max(1, s.decode_steps // rounds)
    rows = []
    for batch_size in s.decode_batches:
        started = {name: start_decodes(e, batch_size, s.decode_context) for name, e in (("a", llm), ("p", paged))}
        hf = HFDecodes(model, batch_size, s.decode_context)
        times: dict[str, list[float]] = {"step": [], "forward": [], "paged": [], "hf": []}

        def splitserve_turn() -> dict[str, list[float]]:
            step_s, forward_s = timed_steps(llm, per_round)
            return {"step": step_s, "forward": forward_s}

        turns = [
            splitserve_turn,
            lambda: {"paged": timed_steps(paged, per_round)[1]},
            lambda: {"hf": hf.forward_s(per_round)},
        ]
        for r in range(rounds):
            for turn in range(len(turns)):
                for name, values in turns[(turn + r) % len(turns)]().items():
                    times[name] += values
        for name, e in (("a", llm), ("p", paged)):
            for request_id in started[name]:
                e.engine.abort_request(request_id)
        ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
        rows.append(
            {
                "batch": batch_size,
                "step_ms": ms["step"],
                "forward_ms": ms["forward"],
                "step_over_forward": ms["step"] / ms["forward"],
                "paged_forward_ms": ms["paged"],
                "hf_forward_ms": ms["hf"],
                "forward_over_hf": ms["forward"] / ms["hf"],
                "paged_over_hf": ms["paged"] / ms["hf"],
                "samples_ms": {name: [v * 1e3 for v in values] for name, values in times.items()},
            }
        )
    return rows


def print_throughput(t: dict, wl: list[RequestSpec]) -> None:
    print(
        f"\nThroughput: {len(wl)} requests, {sum(output_lens(wl))} useful output tokens, "
        f"prompt tokens {sum(len(r.prompt_token_ids) for r in wl)}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'system':<34}{'seconds':>10}{'out tok/s':>12}{'same tokens as (a)':>20}")
    labels = {
        "a_splitserve": "(a) splitserve LLM.generate",
        "b_hf_static8": "(b) HF generate, static batch 8",
        "c_hf_continuous": "(c) HF continuous batching",
    }
    for key, label in labels.items():
        if key in t:
            r, same = t[key], f"{t[key]['identical_to_a']}/{len(wl)}"
            print(f"{label:<34}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.1f}{same:>20}")
    bound = t["compute_bound"]
    print(
        f"prefill only (same prompts, first token): {t['prefill_only_s']:.2f} s; at its cost per token, "
        f"(a)'s {bound['forwarded_tokens']} forwarded tokens need at least {bound['seconds']:.2f} s "
        f"((a) took {t['a_splitserve']['seconds'] / bound['seconds']:.2f}x that)"
    )
    for key in ("b", "c"):
        if f"ratio_a_over_{key}" in t:
            print(f"ratio (a)/({key}): {t[f'ratio_a_over_{key}']:.2f}x; at that bound: {t[f'bound_over_{key}']:.2f}x")
    prefill, decode = t["a_steps"]["prefill"], t["a_steps"]["decode"]
    print(
        f"(a)'s steps: {prefill['steps']} with prompt chunks, {prefill['seconds']:.2f} s, {prefill['tokens']} tokens; "
        f"{decode['steps']} decode-only, {decode['seconds']:.2f} s, {decode['seqs']} rows over "
        f"{decode['mean_context']:.0f} tokens of context on average"
    )


def print_decode(rows: list[dict], s: Settings) -> None:
    print(f"\nDecode step, {s.decode_context}-token contexts (growing), medians of {s.decode_steps} steps each")
    print(
        f"{'batch':>6}{'step ms':>10}{'forward ms':>12}{'step/fwd':>10}{'paged fwd ms':>14}{'HF fwd ms':>11}"
        f"{'fwd/HF':>8}{'paged/HF':>10}"
    )
    for r in rows:
        print(
            f"{r['batch']:>6}{r['step_ms']:>10.1f}{r['forward_ms']:>12.1f}{r['step_over_forward']:>10.2f}"
            f"{r['paged_forward_ms']:>14.1f}{r['hf_forward_ms']:>11.1f}{r['forward_over_hf']:>8.2f}"
            f"{r['paged_over_hf']:>10.2f}"
        )


def print_prefill(rows: list[dict], repeats: int) -> None:
    print(f"\nPrefill: seconds to the first token of one fresh prompt, median of {repeats}")
    print(
        f"{'tokens':>7}{'splitserve':>12}{f'chunks {CHUNK_BUDGET}':>12}{'HF last':>10}{'HF all':>9}{'ss/HF last':>12}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>7}{r['splitserve_s']:>12.2f}{r['splitserve_chunked_s']:>12.2f}"
            f"{r['hf_last_logits_s']:>10.2f}{r['hf_all_logits_s']:>9.2f}{r['splitserve_over_hf_last']:>12.2f}"
        )


def print_prefix(r: dict, repeats: int) -> None:
    print(
        f"\nPrefix hit, {r['prompt_tokens']}-token prompts, median of {repeats}: cold {r['cold_s']:.2f} s, "
        f"{r['cached_tokens']} tokens cached {r['hit_s']:.3f} s, cold / hit {r['cold_over_hit']:.1f}x (target >= 8x)"
    )


def conditions(threads: int) -> dict:
    import transformers

    return {
        "torch_threads": threads,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_before": os.getloadavg(),
    }


def engine_config(budget: int | None = None, decode_mirror_bytes: int | None = None) -> EngineConfig:
    """The benchmark's engine; with a token budget (chunked prefill), one with a small KV cache beside it."""
    if budget is None:
        return EngineConfig(
            dtype="float32",
            device="cpu",
            cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES, decode_mirror_bytes=decode_mirror_bytes),
            scheduler=SchedulerConfig(max_num_seqs=64),
        )
    return EngineConfig(
        dtype="float32",
        device="cpu",
        cache=CacheConfig(kv_cache_bytes=CHUNKED_KV_CACHE_BYTES),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small workload, finishes in a minute or two")
    parser.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated, of {','.join(TABLES)}")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for both systems (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts per prefill / prefix-hit row")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument(
        "--decode-mirror-bytes",
        type=int,
        default=None,
        help="splitserve's --decode-mirror-bytes (0: decodes gather from the paged cache; default: the engine's)",
    )
    args = parser.parse_args()
    args.tables = args.tables.split(",")
    if unknown := set(args.tables) - set(TABLES):
        parser.error(f"unknown tables {sorted(unknown)}; choose from {','.join(TABLES)}")
    return args


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    llm = LLM(engine_config(decode_mirror_bytes=args.decode_mirror_bytes))
    vocab_size = llm.engine.runner.arch.vocab_size
    model = load_hf()
    result: dict = {
        "settings": asdict(s),
        "decode_mirror_bytes": args.decode_mirror_bytes,
        "conditions": conditions(torch.get_num_threads()),
    }
    if "throughput" in args.tables:
        wl = make_requests(s.workload(vocab_size))
        result["throughput"] = throughput_table(llm, model, wl, vocab_size)
        print_throughput(result["throughput"], wl)
    if "decode" in args.tables:
        result["decode"] = decode_table(llm, model, s)
        print_decode(result["decode"], s)
    if "prefill" in args.tables:
        llms = {"splitserve": llm, "splitserve_chunked": LLM(engine_config(CHUNK_BUDGET))}
        result["prefill"] = prefill_table(llms, model, args.repeats, vocab_size)
        print_prefill(result["prefill"], args.repeats)
    if "prefix" in args.tables:
        result["prefix_hit"] = prefix_table(llm, args.repeats, vocab_size)
        print_prefix(result["prefix_hit"], args.repeats)
    result["conditions"]["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
