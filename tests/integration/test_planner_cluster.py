"""The planner on real processes (issue 17): a load that steps from light to a prefill-heavy burst makes
the reactive planner add a prefill worker within 30 s and the TTFT p90 recover; when the load falls it
drains back to one prefill worker, and no request fails on the way.

The system is 1P1D on a model wide enough that a 400-token prefill costs ~0.3 s on one core. The burst
is open loop at 1.2x what one prefill worker was measured to sustain at best, so with one worker its
queue (and TTFT) grows without end; with two it drains. The planner runs as `splitserve planner` does: it scrapes
the gateway's registry and /metrics and the workers', and calls the Launcher's Scale over gRPC.
"""

from __future__ import annotations

import io
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from cluster_helpers import drained_empty, greedy_request, metric, stub

from splitserve.common.roles import Role
from splitserve.common.security import OPEN_CLUSTER
from splitserve.services.launcher.launcher import start_cluster, stop_cluster
from splitserve.services.launcher.supervisor import Supervisor, serve_launcher
from splitserve.services.planner.capacity import SloTargets
from splitserve.services.planner.loop import LauncherScaler, PlannerLoop
from splitserve.services.planner.metrics import PlannerMetrics
from splitserve.services.planner.policy import Bounds, Mode, PlannerConfig, TierBounds, make_policy
from splitserve.services.planner.reader import ClusterScraper

LONG, SHORT = 400, 16  # prompt tokens: the burst's and the light load's
INTERVAL_S = 2.0


def wide_argv(folder) -> list[str]:
    kv_bytes = str(256 * 1024**2)  # room to reserve for a backlog of 400-token prompts at decode
    return ["--model", str(folder), "--kv-cache-bytes", kv_bytes, "--block-size", "16", "--max-model-len", "512"]


@dataclass(frozen=True, slots=True)
class Outcome:
    sent_at: float
    prompt_tokens: int
    ttft_s: float | None  # None: failed
    error: str = ""


class OpenLoad:
    """Requests started on a fixed schedule whatever the earlier ones are doing (an open loop), at a rate
    and prompt length that can change while it runs; every outcome is kept."""

    def __init__(self, address: str) -> None:
        self.stub, self.outcomes = stub(address), []
        self.rate, self.prompt_tokens = 0.0, SHORT
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=96)
        self._thread = threading.Thread(target=self._dispatch, daemon=True)
        self._rng = random.Random(0)

    def set(self, rate: float, prompt_tokens: int) -> None:
        self.rate, self.prompt_tokens = rate, prompt_tokens

    def _dispatch(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self.rate <= 0:
                next_at = time.monotonic() + 0.05
                self._stop.wait(0.05)
                continue
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            prompt = [self._rng.randrange(3, 300) for _ in range(self.prompt_tokens)]  # fresh: no prefix hits
            self._pool.submit(self._one, prompt)
            next_at += 1.0 / self.rate

    def _one(self, prompt: list[int]) -> None:
        sent = time.monotonic()
        try:
            first = None
            for chunk in self.stub.Generate(greedy_request(prompt, 2), timeout=120):
                if first is None and chunk.token_ids:
                    first = time.monotonic() - sent
            self.outcomes.append(Outcome(sent, len(prompt), first))
        except grpc.RpcError as e:
            self.outcomes.append(Outcome(sent, len(prompt), None, f"{e.code().name}: {e.details()}"))

    def ttft_p90(self, since: float, until: float) -> float | None:
        """Of the long-prompt requests sent in [since, until) that have finished."""
        ttfts = sorted(
            o.ttft_s
            for o in list(self.outcomes)
            if since <= o.sent_at < until and o.prompt_tokens == LONG and o.ttft_s is not None
        )
        return ttfts[int(0.9 * (len(ttfts) - 1))] if len(ttfts) >= 5 else None

    def __enter__(self) -> OpenLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pool.shutdown(wait=True)


def _measure_prefill(address: str, prefill) -> float:
    """The fastest of 8 long prompts sent one at a time (the first few compile and warm caches, so they
    are not counted). A mean is slow when anything else runs meanwhile: on one CI run the burst at 1.2x
    of it did not overload the worker (its TTFT p90 hovered around the target) and the planner rightly held."""
    client, rng = stub(address), random.Random(1)
    for _ in range(3):
        list(client.Generate(greedy_request([rng.randrange(3, 300) for _ in range(LONG)], 2), timeout=60))
    times = []
    for _ in range(8):
        before = metric(prefill.metrics, "splitserve_request_prefill_time_seconds_sum")
        list(client.Generate(greedy_request([rng.randrange(3, 300) for _ in range(LONG)], 2), timeout=60))
        times.append(metric(prefill.metrics, "splitserve_request_prefill_time_seconds_sum") - before)
    return min(times)


def _planner_config(ttft_target_s: float) -> PlannerConfig:
    tiers = {Role.PREFILL: TierBounds(1, 2), Role.DECODE: TierBounds(1, 1)}
    return PlannerConfig(
        targets=SloTargets(ttft_target_s, 10.0),  # ITL never at fault: only the prefill tier moves
        bounds=Bounds(tiers, 3),
        mode=Mode.REACTIVE,
        up_intervals=2,
        down_intervals=3,
        low_watermark=0.5,
        cooldown_s=10.0,
        up_cooldown_s=30.0,
    )


def _wait_for(predicate, timeout_s: float, poll_s: float = 0.25) -> float | None:
    """Seconds until predicate() held, or None if it did not within timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(poll_s)
    return None


def test_burst_adds_a_prefill_worker_then_drains_back_without_failures(wide_llama_dir):
    argv = wide_argv(wide_llama_dir)
    children = start_cluster(0, argv, num_prefill=1, num_decode=1)
    supervisor = Supervisor(children, argv, "127.0.0.1")
    launcher = serve_launcher(supervisor, "127.0.0.1", 0)
    gateway, prefill = children[0], children[1]
    log, stop = io.StringIO(), threading.Event()
    try:
        prefill_s = _measure_prefill(gateway.address, prefill)
        target_s = max(1.0, 4 * prefill_s)
        loop = PlannerLoop(
            make_policy(_planner_config(target_s)),
            ClusterScraper(gateway.address, gateway.metrics, OPEN_CLUSTER).scrape,
            PlannerMetrics(),
            log,
            LauncherScaler(supervisor.admin_address, OPEN_CLUSTER),
        )
        planner = threading.Thread(target=loop.run, args=(INTERVAL_S, stop), daemon=True)
        planner.start()
        with OpenLoad(gateway.address) as load:
            load.set(1.0, SHORT)
            time.sleep(3 * INTERVAL_S)
            assert len(supervisor.workers("prefill")) == 1, log.getvalue()

            burst_at = time.monotonic()
            load.set(1.2 / prefill_s, LONG)
            added_after = _wait_for(lambda: len(supervisor.workers("prefill")) == 2, 30.0)
            assert added_after is not None, f"no prefill worker added within 30 s:\n{log.getvalue()}"
            both = list(supervisor.workers("prefill"))
            # The new worker is spawned now; it takes traffic once healthy, and the backlog drains from then.
            added_at = burst_at + added_after

            def recovered() -> bool:
                now = time.monotonic()
                p90 = load.ttft_p90(max(added_at, now - 6.0), now - 1.0)
                return p90 is not None and p90 < target_s

            # Without the second worker the backlog only grows (1.2x one worker's measured rate). With it,
            # on 2 cores shared by 2 prefill workers, the decode worker, the gateway and this load, the
            # margin over the arrivals is small: a fresh-clone CI run drained a 41-request backlog at
            # ~0.6 requests/s and was still 3.96 s over the target after 75 s, with p90 falling.
            assert _wait_for(recovered, 150.0, poll_s=1.0) is not None, (
                f"TTFT p90 did not recover below {target_s:.2f} s with 2 prefill workers: "
                f"{load.ttft_p90(time.monotonic() - 6.0, time.monotonic())}\n{log.getvalue()}"
            )

            load.set(1.0, SHORT)
            drained_after = _wait_for(lambda: len(supervisor.workers("prefill")) == 1, 90.0)
            assert drained_after is not None, f"not drained back to one prefill worker:\n{log.getvalue()}"
            time.sleep(INTERVAL_S)
        (drained,) = [c for c in both if c.proc.poll() is not None]
        assert drained.proc.returncode == 0 and drained_empty(drained), list(drained.log)[-5:]
        failed = [o for o in load.outcomes if o.ttft_s is None]
        assert not failed, failed[:5]
        assert len(load.outcomes) > 50
        decisions = [json.loads(line) for line in log.getvalue().splitlines()]
        decisions = [d for d in decisions if d["event"] == "decision"]
        (up,) = [d for d in decisions if d["tiers"]["prefill"]["action"] == "up"]
        assert up["tiers"]["prefill"]["reason"] == "ttft_over" and up["observation"]["ttft_p90_s"] > target_s
        assert decisions[-1]["tiers"]["prefill"]["desired"] == 1
        assert all(d["tiers"]["decode"]["desired"] == 1 for d in decisions)
    finally:
        stop.set()
        launcher.stop(grace=1)
        stop_cluster(supervisor.children)
