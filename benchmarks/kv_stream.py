"""Layer-by-layer KV streaming, as a timeline (issue 18, item 2): one prefill engine (bundled SmolLM2
fp32, --threads torch threads) sends each prompt's KV over a real gloo pair (TorchDistSender to a
TorchDistReceiver in this process, on their own threads) from a prefill worker's engine core, stepping
on a thread of this process (EngineCoreClient.in_process with the worker's CorePrefillSetup, its
sender swapped for that TorchDistSender), fed Prefill calls as a worker's serving side forwards them.
Whether the core sends after the first token ("after") or streams the layers as the prompt's last
step computes them ("streamed") is the core's setting: each prompt length runs its prompts on an
"after" core, then the same prompts on a "streamed" core, one core at a time on the same engine
(two step loops at once would give two OpenMP pools on this machine's cores: services/engine/cpu_threads.py).

Recorded per request, from its submission: each layer of the last step marked written (the
step thread), each chunk gathered by the sender (then it goes on the wire), each chunk landed and hashed by
the receiver, the first token (as the serving side gets it), the end of the receive. The decode worker could
compute the second token at max(first token, all KV landed); "landed after first token" is what streaming
shortens.

Both sides share this machine's cores (2 here), so the sender's gather and the receiver's hash
compete with the forward; on a GPU host the forward runs on the device and the wire is NCCL.

Usage: python benchmarks/kv_stream.py [--lengths 256,1024,2048,4096] [--repeats 3] [--threads 2]
           [--json PATH] [--plot PATH.png]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import params_to_proto
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.disagg.handoff import FirstToken, HandoffJob, PieceJob, SendStarted, TransferDone
from splitserve.services.disagg.plan import Piece
from splitserve.services.disagg.prefill import CorePrefillSetup
from splitserve.services.disagg.prefill_client import event_from_proto, job_to_proto
from splitserve.services.disagg.transfer.base import ChannelSpec
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.cpu_threads import on_passing_thread
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort, piece_buffer, release_piece_buffer
from splitserve.services.engine.layer_progress import LayerProgress

KV_CACHE_BYTES = 1024**3
VOCAB = 49152
TIMEOUT_S = 60.0


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
    """Record each layer marked written, and each chunk the sender gathers (in the core: this process)."""
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


@dataclass(frozen=True)
class TorchDistPrefill(CorePrefillSetup):
    """A prefill worker's core setup whose sender is torch_dist's, in the core's process (a CPU
    worker's would be in its KV agent's)."""

    def make_sender(self, device: torch.device) -> TorchDistSender:
        return TorchDistSender(self.host, self.transfer_timeout_s, device)


async def one_request(
    engine: Engine, client: EngineCoreClient, receiver: TorchDistReceiver, channel: ChannelSpec, prompt: list[int]
) -> dict:
    """One Prefill call through the core; the receive posted at the first event (as a decode worker does)."""
    heads = range(client.num_kv_heads)
    tag = receiver.next_tag(channel)
    job = HandoffJob((PieceJob(Piece(0, 0, heads), channel, tag),), 0, engine.runner.kv_layout)
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=2))
    wire = wpb.WorkerGenerateRequest(request_id="kv-stream", prompt_token_ids=prompt, params=params)
    call = job_to_proto(job, wire)
    num_blocks = -(-len(prompt) // client.block_size)  # no prefix skipped
    staging = piece_buffer(engine.runner, num_blocks, len(heads))  # the decode side's buffer
    recorder = RECORDER
    recorder.start()

    def landed(rows: slice) -> None:
        recorder.add("landed", recorder.now(), rows.start, rows.stop)

    recv: asyncio.Task | None = None
    times: dict[str, float] = {}
    async for core_event in client.prefill(call):
        now = recorder.now()
        event = event_from_proto(wpb.PrefillResponse.FromString(core_event.response))
        if isinstance(event, SendStarted):
            times["send_started_s"] = now
        elif isinstance(event, FirstToken):
            times["first_token_s"] = now
        elif isinstance(event, TransferDone):
            times["transfer_done_s"] = now
        if recv is None and isinstance(event, (SendStarted, FirstToken)):
            assert event.num_blocks == num_blocks, (event.num_blocks, num_blocks)
            recv = asyncio.ensure_future(receiver.recv(channel, tag, staging.tensor, landed))
    assert recv is not None
    await recv
    times["all_landed_s"] = max(e[1] for e in recorder.events if e[0] == "landed")
    times["landed_after_first_token_s"] = max(times["all_landed_s"] - times["first_token_s"], 0.0)
    times["second_token_ready_s"] = max(times["all_landed_s"], times["first_token_s"])
    release_piece_buffer(engine.runner, staging)
    return {**times, "num_blocks": num_blocks, "events": list(recorder.events)}


async def run_on_core(
    engine: Engine, receiver: TorchDistReceiver, channel: ChannelSpec, stream: bool, prompts: list[list[int]]
) -> list[dict]:
    """The prompts, one at a time, on a prefill core of their own (its sender joins channel); its
    first request, a short one, builds the pair's group and warms the path up (not recorded)."""
    setup = TorchDistPrefill("127.0.0.1", TIMEOUT_S, kv_streaming=stream)
    client = EngineCoreClient.in_process(engine, setup)
    try:
        await one_request(engine, client, receiver, channel, prompts[0][:64])
        return [await one_request(engine, client, receiver, channel, prompt) for prompt in prompts]
    finally:
        await client.shutdown()  # its sender closes with it


RECORDER = Recorder()


async def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    # No prefix cache: both modes compute the same prompt from scratch.
    cache = CacheConfig(kv_cache_bytes=KV_CACHE_BYTES, enable_prefix_caching=False)
    engine = on_passing_thread(Engine, EngineConfig(cache=cache))  # the step loop's OpenMP pool is the only one
    receiver = TorchDistReceiver("127.0.0.1", TIMEOUT_S)
    _patch(RECORDER)
    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    cores = itertools.count()
    result: dict = {"lengths": lengths, "repeats": args.repeats, "threads": args.threads, "runs": {}}
    for n in lengths:
        prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for _ in range(args.repeats)]  # no prefix hit
        rows: dict[str, list[dict]] = {}
        for mode in ("after", "streamed"):
            channel = receiver.channel_for(f"prefill-{next(cores)}")  # each core's sender is a new peer
            rows[mode] = await run_on_core(engine, receiver, channel, mode == "streamed", prompts)
            receiver.drop(channel)
        result["runs"][n] = rows
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
