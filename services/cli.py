"""`splitserve` command line. This issue ships `generate`; later issues add `up`, `worker`, `bench`."""

from __future__ import annotations

import argparse
import sys
import time

from splitserve.services.config import CacheConfig, EngineConfig, SchedulerConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    g.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    g.add_argument("--attention-backend", default=None, help="attention backend name (default: per device)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-bytes", type=int, default=None, help="KV cache budget in bytes")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--seed", type=int, default=0)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, attention_backend=a.attention_backend,
        max_model_len=a.max_model_len, seed=a.seed,
        cache=CacheConfig(block_size=a.block_size, kv_cache_bytes=a.kv_cache_bytes,
                          enable_prefix_caching=not a.no_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                                  policy=a.policy),
    )


def _generate(a: argparse.Namespace) -> int:
    from splitserve.services.engine.engine import Engine
    from splitserve.services.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                            seed=a.sampling_seed, stop=a.stop or ())
    engine = Engine(engine_config_from_args(a))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    start = time.monotonic()
    engine.add_request(prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            last = out
    elapsed = time.monotonic() - start
    if last is not None:
        print(f"\n[{last.num_output_tokens} tokens, {last.num_output_tokens / elapsed:.1f} tok/s, "
              f"TTFT {last.timings.get('ttft_ms', 0):.0f} ms, finish: {last.finish_reason.value}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text in process and stream it to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
