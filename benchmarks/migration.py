"""What a stream moved off a killed worker costs its client (gateway/generation.py, stream migration).

Each trial starts a gateway and two unified workers (SmolLM2, bundled, 2 torch threads each), streams
one greedy request (a random prompt of --prompt-len tokens, --output-len tokens), SIGKILLs the worker
streaming it after --kill-after tokens, and reads the rest, which the other worker computes (the prompt
and the tokens so far, in one pass) and streams on. Reported per trial, from the client's clock:
  gap      the time between the last token before the kill and the first one after it;
  ITL      the median gap between the stream's other tokens;
  added    gap - ITL: what the move added;
and whether the stream equals the same request sent again, unfaulted, to the surviving worker.

Usage: python benchmarks/migration.py [--trials 3 --prompt-len 256 --output-len 64 --kill-after 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import time
from pathlib import Path

import grpc

from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.launcher import start_cluster, stop_cluster


def _request(prompt: list[int], output_len: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParameters(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=output_len, ignore_eos=True),
    )


def _busy(workers) -> object:
    """The worker running the one stream (polled: it is the only request in the cluster)."""
    while True:
        for w in workers:
            report = wpb_grpc.WorkerStub(grpc.insecure_channel(w.address)).GetLoad(wpb.GetLoadRequest(), timeout=5)
            if report.num_running:
                return w
        time.sleep(0.005)


def trial(prompt: list[int], output_len: int, kill_after: int) -> dict:
    children = start_cluster(2, [], worker_argv=["--num-threads", "2"])
    try:
        gateway, workers = children[0], children[1:]
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(gateway.address))
        tokens: list[int] = []
        times: list[float] = []
        killed_at = None
        for chunk in stub.Generate(_request(prompt, output_len), timeout=300):
            tokens += chunk.token_ids
            times += [time.monotonic()] * len(chunk.token_ids)
            if killed_at is None and len(tokens) >= kill_after:
                victim = _busy(workers)
                victim.proc.send_signal(signal.SIGKILL)
                killed_at = len(tokens)
        survivor = next(w for w in workers if w is not victim)
        again = [t for c in stub.Generate(_request(prompt, output_len), timeout=300) for t in c.token_ids]
        gaps = [b - a for a, b in zip(times, times[1:])]
        gap = gaps[killed_at - 1]
        itl = statistics.median(gaps[: killed_at - 1] + gaps[killed_at:])
        return {
            "killed_after_tokens": killed_at,
            "gap_ms": gap * 1e3,
            "itl_ms": itl * 1e3,
            "added_ms": (gap - itl) * 1e3,
            "num_tokens": len(tokens),
            "equal_to_unfaulted": tokens == again,
            "survivor": survivor.name,
        }
    finally:
        stop_cluster(children)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kill-after", type=int, default=16)
    parser.add_argument("--json", metavar="PATH", help="also write the figures there, as JSON")
    a = parser.parse_args()
    rng = random.Random(0)
    rows = []
    for _ in range(a.trials):
        prompt = [rng.randrange(1, 49152) for _ in range(a.prompt_len)]
        rows.append(trial(prompt, a.output_len, a.kill_after))
    print(
        f"\nstream migration: {a.trials} trials, prompt {a.prompt_len} tokens, {a.output_len} output tokens, "
        f"worker SIGKILLed after {a.kill_after}; SmolLM2 fp32, 2 torch threads per worker; ms"
    )
    print(f"{'trial':<7}{'killed at':>10}{'gap':>9}{'ITL':>8}{'added':>9}  equal to unfaulted")
    for i, r in enumerate(rows):
        print(
            f"{i:<7}{r['killed_after_tokens']:>10}{r['gap_ms']:>9.1f}{r['itl_ms']:>8.1f}{r['added_ms']:>9.1f}"
            f"  {r['equal_to_unfaulted']}"
        )
    print(f"median added: {statistics.median(r['added_ms'] for r in rows):.1f} ms")
    if a.json:
        settings = {k: getattr(a, k) for k in ("trials", "prompt_len", "output_len", "kill_after")}
        Path(a.json).write_text(json.dumps({"settings": settings, "trials": rows}, indent=2))


if __name__ == "__main__":
    main()
