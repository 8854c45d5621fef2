"""The planner's loop: every interval scrape, decide, log the decision with its inputs as one JSON line,
export it as metrics, and ask the launcher for the new shape (not with --dry-run).

The launcher's Scale call returns once new workers are up and drained ones gone (minutes), so it runs on
a thread of its own; while one is in flight, decisions are still made and logged, not sent. A drained
worker finishes (decode) or sends (prefill) what it holds before it exits: the launcher's drain.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TextIO

import grpc

from splitserve.common.roles import Role
from splitserve.common.security import ClusterSecurity
from splitserve.services.planner.metrics import PlannerMetrics
from splitserve.services.planner.policy import Decision, Policy
from splitserve.services.planner.reader import Scrape, observe


class ScaleFailed(Exception):
    """A Scaler could not give the system the shape asked for; the message says why. The loop logs it and
    decides again at the next interval."""


class Scaler(Protocol):
    def scale(self, desired: Mapping[Role, int]) -> str:
        """Make each tier this size; returns the system's shape afterwards. Blocks until it is.
        Raises ScaleFailed when it cannot."""
        ...


class LauncherScaler:
    """The Launcher service of `splitserve up` (services/launcher/supervisor.py)."""

    def __init__(self, address: str, cluster: ClusterSecurity, timeout_s: float = 900.0) -> None:
        self.address, self.cluster, self.timeout_s = address, cluster, timeout_s

    def scale(self, desired: Mapping[Role, int]) -> str:
        from splitserve.protos.v1 import launcher_pb2 as pb
        from splitserve.protos.v1 import launcher_pb2_grpc as pb_grpc

        request = pb.ScaleRequest(**{f"num_{role.value}": count for role, count in desired.items()})
        with self.cluster.blocking_channel(self.address, to_worker=False) as channel:
            try:
                return pb_grpc.LauncherStub(channel).Scale(request, timeout=self.timeout_s).shape
            except grpc.RpcError as e:
                raise ScaleFailed(f"{e.code().name}: {e.details()}") from e


class PlannerLoop:
    def __init__(
        self,
        policy: Policy,
        scrape: Callable[[], Scrape],
        metrics: PlannerMetrics,
        log: TextIO,
        scaler: Scaler | None = None,  # None: dry run (log and export only)
    ) -> None:
        self.policy, self.scrape, self.metrics, self.log, self.scaler = policy, scrape, metrics, log, scaler
        self._previous: Scrape | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner-scale")
        self._pending: Future[str] | None = None

    def step(self) -> Decision | None:
        """One interval; None on the first scrape (rates need two) or when the scrape failed."""
        self._report_scale_result()
        try:
            scrape = self.scrape()
        except (OSError, grpc.RpcError) as e:  # the gateway is away: keep the last scrape, try next interval
            self._write({"event": "scrape_failed", "error": f"{type(e).__name__}: {e}"})
            return None
        previous, self._previous = self._previous, scrape
        if previous is None:
            return None
        decision = self.policy.decide(observe(previous, scrape))
        result = self._maybe_scale(decision)
        self._write({"event": "decision", **decision.to_json(), "scale": result})
        self.metrics.record(decision, result)
        return decision

    def run(self, interval_s: float, stop: threading.Event) -> None:
        while not stop.is_set():
            self.step()
            stop.wait(interval_s)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _maybe_scale(self, decision: Decision) -> str:
        if self.scaler is None:
            return "dry_run"
        if not decision.changed:
            return "unchanged"
        if self._pending is not None and not self._pending.done():
            return "in_flight"
        self._pending = self._executor.submit(self.scaler.scale, decision.desired())
        return "sent"

    def _report_scale_result(self) -> None:
        """Log the last Scale call once it has returned."""
        if self._pending is None or not self._pending.done():
            return
        pending, self._pending = self._pending, None
        try:
            self._write({"event": "scaled", "shape": pending.result()})
        except ScaleFailed as e:
            self.metrics.scale_calls.labels(result="failed").inc()
            self._write({"event": "scale_failed", "error": str(e)})

    def wait_for_scale(self, timeout_s: float | None = None) -> None:
        """Block until the Scale call in flight (if any) has returned, and log it."""
        if self._pending is not None:
            self._pending.exception(timeout=timeout_s)
        self._report_scale_result()

    def _write(self, record: dict) -> None:
        self.log.write(json.dumps(record) + "\n")
        self.log.flush()
