"""Layer-by-layer KV streaming, as a timeline (issue 18, item 2): one prefill engine (bundled SmolLM2
fp32, --threads torch threads) sends each prompt's KV over a real gloo pair (TorchDistSender to a
TorchDistReceiver in this process, on their own threads) with the handoff's own code
(services/disagg/prefill.py prefill_and_send), once sending after the first token ("after") and once
streaming the layers as the prompt's last step computes them ("streamed"), back to back per prompt.

Recorded per request, from its submission: each layer of the last step marked written (the
step thread), each chunk gathered by the sender (then it goes on the wire), each chunk landed and hashed by
the receiver, the first token, the end of the receive. The decode worker could compute the second
token at max(first token, all KV landed); "landed after first token" is what streaming shortens.

Both sides share this machine's cores (2 here), so the sender's gather and the receiver's hash
compete with the forward; on a GPU host the forward runs on the device and the wire is NCCL.

Usage: python benchmarks/kv_stream.py [--lengths 256,1024,2048,4096] [--repeats 3] [--threads 2]
           [--json PATH] [--plot PATH.png]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.disagg.handoff import FirstToken, HandoffJob, PieceJob, SendStarted, TransferDone
from splitserve.services.disagg.plan import Piece
from splitserve.services.disagg.prefill import prefill_and_send
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.services.engine.async_engine import AsyncEngine
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.engine.layer_progress import LayerProgress

KV_CACHE_BYTES = 1024**3
VOCAB = 49152


class Recorder:
    """Timestamps (seconds from the current request's submission) of what the patched hooks see."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple] = []

    def start(self) -> None:
        self.t0, self.events = time.perf_counter(), []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, *event) -> None:
        self.events.append(event)


def _patch(recorder: Recorder) -> None:
    """Record each layer marked written, and each chunk the sender gathers."""
    mark = LayerProgress.layer_done

    def layer_done(self: LayerProgress, index: int) -> None:
        mark(self, index)
        recorder.add("layer", recorder.now(), index)

    LayerProgress.layer_done = layer_done  # type: ignore[method-assign]
    reader = HandoffPort.held_reader

    def held_reader(self, *args, **kwargs) -> Callable[[slice], None]:
        fill = reader(self, *args, **kwargs)

        def timed(rows: slice) -> None:  # waits for the rows' layers (streamed), gathers them
            fill(rows)
            recorder.add("gathered", recorder.now(), rows.start, rows.stop)

        return timed

    HandoffPort.held_reader = held_reader  # type: ignore[method-assign]


async def one_request(
    engine: AsyncEngine, receiver: TorchDistReceiver, sender: TorchDistSender, prompt: list[int], stream: bool
) -> dict:
    port = HandoffPort(engine)
    channel = receiver.channel_for("prefill")
    tag = receiver.next_tag(channel)
    heads = range(port.num_kv_heads)
    job = HandoffJob((PieceJob(Piece(0, 0, heads), channel, tag),), 0, port.kv_layout)
    request = port.make_prefill_request(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    num_blocks = request.num_prompt_blocks
    staging = port.acquire_staging(num_blocks, len(heads))
    recorder = RECORDER
    recorder.start()

    def landed(rows: slice) -> None:
        recorder.add("landed", recorder.now(), rows.start, rows.stop)

    recv: asyncio.Task | None = None
    times: dict[str, float] = {}
    async for event in prefill_and_send(engine, request, sender, job, stream=stream):
        now = recorder.now()
        if isinstance(event, SendStarted):
            times["send_started_s"] = now
        elif isinstance(event, FirstToken):
            times["first_token_s"] = now
        elif isinstance(event, TransferDone):
            times["transfer_done_s"] = now
        if recv is None and isinstance(event, (SendStarted, FirstToken)):
            recv = asyncio.ensure_future(receiver.recv(channel, tag, staging.tensor, landed))
    assert recv is not None
    await recv
    times["all_landed_s"] = max(e[1] for e in recorder.events if e[0] == "landed")
    times["landed_after_first_token_s"] = max(times["all_landed_s"] - times["first_token_s"], 0.0)
    times["second_token_ready_s"] = max(times["all_landed_s"], times["first_token_s"])
    port.release_staging(staging)
    await port.release_held(request.request_id)  # already queued by the send; a no-op then
    return {**times, "num_blocks": num_blocks, "events": list(recorder.events)}


RECORDER = Recorder()


async def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    # No prefix cache: both modes compute the same prompt from scratch.
    cache = CacheConfig(kv_cache_bytes=KV_CACHE_BYTES, enable_prefix_caching=False)
    engine = AsyncEngine.from_config(EngineConfig(cache=cache))
    receiver = TorchDistReceiver("127.0.0.1", 60.0)
    sender = TorchDistSender("127.0.0.1", 60.0)
    _patch(RECORDER)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    warm = torch.randint(1, VOCAB, (64,), generator=gen).tolist()
    for stream in (False, True):  # the pair's group, the kernels, both paths once
        await one_request(engine, receiver, sender, warm, stream)
    result: dict = {"lengths": lengths, "repeats": args.repeats, "threads": args.threads, "runs": {}}
    for n in lengths:
        rows: dict[str, list[dict]] = {"after": [], "streamed": []}
        for _ in range(args.repeats):
            prompt = torch.randint(1, VOCAB, (n,), generator=gen).tolist()  # fresh: no prefix hit
            for mode in ("after", "streamed"):
                rows[mode].append(await one_request(engine, receiver, sender, prompt, mode == "streamed"))
        result["runs"][n] = rows
    await engine.shutdown()
    sender.close()
    receiver.close()
    return result


def summary(result: dict) -> dict:
    keys = ("first_token_s", "all_landed_s", "landed_after_first_token_s", "second_token_ready_s")
    table = {}
    for n, rows in result["runs"].items():
        table[n] = {mode: {k: statistics.median(r[k] for r in runs) for k in keys} for mode, runs in rows.items()}
    return table


def plot(result: dict, length: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"][length]
    fig, axes = plt.subplots(2, 1, figsize=(10, 5), sharex=True)
    for ax, mode in zip(axes, ("after", "streamed")):
        r = runs[mode][0]
        events = r["events"]
        layers = [e[1] for e in events if e[0] == "layer"]
        ax.scatter(layers, [2] * len(layers), marker="|", s=80, color="tab:blue", label="layer written (prefill step)")
        for e in events:
            if e[0] == "gathered":
                ax.scatter([e[1]], [1], marker="|", s=80, color="tab:orange")
            elif e[0] == "landed":
                ax.scatter([e[1]], [0], marker="|", s=80, color="tab:green")
        ax.axvline(r["first_token_s"], color="black", linestyle="--", label="first token")
        ax.axvline(r["all_landed_s"], color="tab:red", linestyle=":", label="all KV landed")
        rows = ["decode: chunk landed", "prefill: chunk gathered (sent next)", "prefill: layer written"]
        ax.set_yticks([0, 1, 2], rows)
        ax.set_ylim(-0.5, 2.5)
        after_ms = r["landed_after_first_token_s"] * 1e3
        ax.set_title(f"{mode}: {length}-token prompt, KV landed {after_ms:.0f} ms after the first token")
    axes[0].legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("seconds from the request's submission")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,1024,2048,4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the prefill engine")
    parser.add_argument("--json", metavar="PATH", help="also write the figures there, as JSON (events too)")
    parser.add_argument("--plot", metavar="PATH", help="a PNG timeline of the longest prompt's first request")
    args = parser.parse_args()
    load_before = os.getloadavg()
    result = asyncio.run(run(args))
    table = summary(result)
    print(f"\nmedians of {args.repeats}, seconds from submission ({args.threads} torch threads, gloo in process)")
    print(f"{'prompt':>7}{'mode':>10}{'1st token':>11}{'KV landed':>11}{'after 1st':>11}{'2nd ready':>11}")
    for n, modes in table.items():
        for mode, m in modes.items():
            print(
                f"{n:>7}{mode:>10}{m['first_token_s']:>11.3f}{m['all_landed_s']:>11.3f}"
                f"{m['landed_after_first_token_s']:>11.3f}{m['second_token_ready_s']:>11.3f}"
            )
    if args.plot:
        plot(result, max(result["lengths"]), args.plot)
    if args.json:
        conditions = {"cpu_count": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
        with open(args.json, "w") as f:
            json.dump({"summary": table, "conditions": conditions, **result}, f, indent=1)


if __name__ == "__main__":
    main()
