"""Offline CPU benchmark: splitserve against Hugging Face transformers on SmolLM2-135M (fp32).

Table 1, throughput on one random workload (prompt and output lengths drawn uniformly, fixed seed,
every request generates exactly its output length):
  (a) splitserve LLM.generate on all requests at once (continuous batching);
  (b) transformers generate() in static batches of 8, left padded, in request order. A batch runs
      until its longest output; only each request's own output length counts as useful tokens;
  (c) transformers continuous batching: the manager behind generate_batch, driven directly so each
      request gets its own max_new_tokens; sdpa attention (works on CPU), EOS disabled.
Both engines get a KV cache that holds the whole workload, so neither preempts. Load time and one
short warm-up generate per system are not timed. "same tokens as (a)" counts requests whose greedy
output matches splitserve's token for token (fp32 batching noise and (b)'s padding and EOS masking
may flip a near tie).

Table 2, one decode step at batch B with ~300-token contexts: splitserve engine.step() (schedule,
prepare, forward, sample, update) against a bare runner.forward() on one prepared batch, and
transformers' model forward of one token against a DynamicCache of the same length.

Usage: python benchmarks/offline.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

import torch

from splitserve.common.model_files import default_model_path
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.engine.llm import LLM
from splitserve.experiments.offline import FULL, QUICK, Settings, decode_step_ms, timed
from splitserve.experiments.workload import LengthDist, RequestSpec, WorkloadConfig, make_requests

HF_PAGE_SIZE = 256  # transformers' default page size, tokens per KV block
STATIC_BATCH_SIZE = 8
KV_CACHE_BYTES = 3 * 1024**3  # SmolLM2 fp32 KV is 45 KiB/token: ~68k tokens, all 64 requests fit


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
@torch.inference_mode()
def hf_decode_ms(model, batch_size: int, s: Settings) -> float:
    """ms per model forward of one new token per sequence over a DynamicCache of decode_context tokens."""
    from transformers import DynamicCache

    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    shape = (batch_size, cfg.num_key_value_heads, s.decode_context, head_dim)
    for layer in range(cfg.num_hidden_layers):  # decode cost does not depend on the cached values
        cache.update(torch.randn(shape), torch.randn(shape), layer)
    ids = torch.randint(WorkloadConfig().vocab_low, cfg.vocab_size, (batch_size, 1))  # no special tokens
    mask = torch.ones(batch_size, s.decode_context + 1, dtype=torch.long)
    positions = torch.full((batch_size, 1), s.decode_context)
    total = 0.0
    for i in range(s.decode_steps + 1):
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        total += (time.perf_counter() - start) if i > 0 else 0.0  # first call is warm-up
        cache.crop(-1)  # back to decode_context tokens
    return total * 1e3 / s.decode_steps


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
    out_a, sec_a = timed(run_splitserve, llm, wl)
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
    for name in ("b_hf_static8", "c_hf_continuous"):
        if name in result:
            result[f"ratio_a_over_{name[0]}"] = result["a_splitserve"]["tokens_per_s"] / result[name]["tokens_per_s"]
    return result


def decode_table(llm: LLM, model, s: Settings) -> list[dict]:
    rows = []
    for batch_size in s.decode_batches:
        step_ms, forward_ms = decode_step_ms(llm, batch_size, s.decode_context, s.decode_steps)
        rows.append(
            {
                "batch": batch_size,
                "step_ms": step_ms,
                "forward_ms": forward_ms,
                "step_over_forward": step_ms / forward_ms,
                "hf_forward_ms": hf_decode_ms(model, batch_size, s),
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
    for key in ("b", "c"):
        if f"ratio_a_over_{key}" in t:
            print(f"ratio (a)/({key}): {t[f'ratio_a_over_{key}']:.2f}x")


def print_decode(rows: list[dict], s: Settings) -> None:
    print(f"\nDecode step, {s.decode_context}-token contexts, mean of {s.decode_steps} steps")
    print(f"{'batch':>6}{'step ms':>10}{'forward ms':>12}{'step/fwd':>10}{'HF fwd ms':>11}")
    for r in rows:
        print(
            f"{r['batch']:>6}{r['step_ms']:>10.1f}{r['forward_ms']:>12.1f}"
            f"{r['step_over_forward']:>10.2f}{r['hf_forward_ms']:>11.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small workload, finishes in a minute or two")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    llm = LLM(
        EngineConfig(
            dtype="float32",
            device="cpu",
            cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES),
            scheduler=SchedulerConfig(max_num_seqs=64),
        )
    )
    vocab_size = llm.engine.runner.arch.vocab_size
    model = load_hf()
    wl = make_requests(s.workload(vocab_size))
    throughput = throughput_table(llm, model, wl, vocab_size)
    print_throughput(throughput, wl)
    decode = decode_table(llm, model, s)
    print_decode(decode, s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": asdict(s), "throughput": throughput, "decode": decode}, f, indent=2)


if __name__ == "__main__":
    main()
