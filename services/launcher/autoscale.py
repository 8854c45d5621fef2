"""The SLO planner in this process: `splitserve up --autoscale`, and an autoscaled deployment of
`splitserve experiment`. It is services/planner/loop.py's loop on a thread of its own, scraping the gateway's and
the workers' /metrics as `splitserve planner` does, and scaling through the Supervisor directly instead
of the Launcher RPC. `up` stops it before the workers: no decision starts a worker while they stop.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TextIO

from splitserve.common.roles import Role
from splitserve.common.security import ClusterSecurity
from splitserve.common.serving import start_metrics_server
from splitserve.services.launcher.launcher import Child
from splitserve.services.planner.cli import planner_config_from_args
from splitserve.services.planner.loop import PlannerLoop, ScaleFailed, Scaler
from splitserve.services.planner.metrics import PlannerMetrics
from splitserve.services.planner.policy import Mode, PlannerConfig, Policy, make_policy
from splitserve.services.planner.reader import ClusterScraper


class Scalable(Protocol):
    """What the planner needs of services/launcher/supervisor.py's Supervisor."""

    def scale(self, wanted: dict[str, int]) -> object: ...

    def shape(self) -> str: ...


class SupervisorScaler:
    """The planner's Scaler for a Supervisor in this process: each tier's Role value is the Supervisor's mode."""

    def __init__(self, supervisor: Scalable) -> None:
        self.supervisor = supervisor

    def scale(self, desired: Mapping[Role, int]) -> str:
        try:
            self.supervisor.scale({role.value: count for role, count in desired.items()})
        except ValueError as e:
            raise ScaleFailed(f"INVALID_ARGUMENT: {e}") from e
        except (RuntimeError, TimeoutError) as e:
            raise ScaleFailed(f"UNAVAILABLE: a new worker did not come up: {e}") from e
        return self.supervisor.shape()


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    """What the in-process planner runs with: `up`'s planner flags, or an experiment's autoscale table."""

    config: PlannerConfig
    interval_s: float = 10.0  # between decisions
    dry_run: bool = False  # decide and log only
    profile: str | None = None  # the performance profile file (predictive)

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"the planner's interval_s must be > 0, got {self.interval_s}")
        if self.config.mode is Mode.PREDICTIVE and self.profile is None:
            raise ValueError("the predictive planner needs a performance profile (splitserve profile): give its file")

    @classmethod
    def from_args(cls, a: argparse.Namespace, colocated: bool | None = None) -> AutoscaleSettings:
        """From services/planner/cli.py's add_policy_args options; colocated as planner_config_from_args takes it."""
        if a.ttft_ms is None or a.itl_ms is None:
            raise ValueError("autoscaling needs the p90 targets: --ttft-ms and --itl-ms")
        return cls(planner_config_from_args(a, colocated), a.interval_s, a.dry_run, a.profile)

    def make_policy(self) -> Policy:
        from splitserve.services.planner.profile import Profile

        return make_policy(self.config, Profile.load(self.profile) if self.profile else None)

    def minimum(self) -> dict[Role, int]:
        """Each planned tier's fewest workers."""
        return {role: bounds.min_workers for role, bounds in self.config.bounds.tiers.items()}

    def make_loop(
        self,
        gateway: Child,
        cluster: ClusterSecurity,
        scaler: Scaler,
        log: TextIO,
        metrics: PlannerMetrics | None = None,
    ) -> PlannerLoop:
        """A PlannerLoop scraping the gateway (and the workers it lists), scaling with scaler unless a dry run."""
        scrape = ClusterScraper(gateway.registry, gateway.metrics, cluster).scrape
        scaler_or_none = None if self.dry_run else scaler
        return PlannerLoop(self.make_policy(), scrape, metrics or PlannerMetrics(), log, scaler_or_none)


class PlannerThread:
    """A PlannerLoop deciding every interval on a thread of its own until stop()."""

    def __init__(self, loop: PlannerLoop, interval_s: float) -> None:
        self.loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=loop.run, args=(interval_s, self._stop), name="planner", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 15.0) -> None:
        """No more decisions: returns once the one being made (a scrape times out in 5 s) is done. A Scale
        in flight goes on: wait_for_scale."""
        self._stop.set()
        self._thread.join(timeout_s)

    def wait_for_scale(self, timeout_s: float) -> bool:
        """After stop(): wait for a Scale in flight and log its end; False when it is still running."""
        try:
            self.loop.wait_for_scale(timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass(frozen=True, slots=True)
class UpPlanner:
    """`splitserve up --autoscale`: the planner's settings, where its decisions go, its /metrics port."""

    settings: AutoscaleSettings
    log_path: Path | None  # JSON lines appended here; None: stderr
    metrics_port: int = 0  # 0: a free one


class RunningPlanner:
    """The planner of a running `up`: started with start(), ended with stop() and close()."""

    def __init__(self, up: UpPlanner, thread: PlannerThread, log: TextIO, metrics_address: str) -> None:
        self.up, self.thread, self.log, self.metrics_address = up, thread, log, metrics_address

    @classmethod
    def start(
        cls, up: UpPlanner, supervisor: Scalable, gateway: Child, cluster: ClusterSecurity, host: str
    ) -> RunningPlanner:
        metrics = PlannerMetrics()
        port = start_metrics_server(metrics.registry, host, up.metrics_port)
        log: TextIO = sys.stderr
        if up.log_path is not None:
            up.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = up.log_path.open("a")  # closed by close()
        loop = up.settings.make_loop(gateway, cluster, SupervisorScaler(supervisor), log, metrics)
        return cls(up, PlannerThread(loop, up.settings.interval_s), log, f"{host}:{port}")

    def describe(self) -> str:
        up = self.up
        where = "stderr" if up.log_path is None else str(up.log_path)
        mode = up.settings.config.mode.value + (", dry run" if up.settings.dry_run else "")
        return (
            f"planner ({mode}, every {up.settings.interval_s:g} s): decisions as JSON lines to {where}; "
            f"metrics http://{self.metrics_address}/metrics"
        )

    def stop(self) -> None:
        """No more decisions (before the workers stop)."""
        self.thread.stop()

    def close(self, timeout_s: float = 30.0) -> None:
        """After the workers were stopped: a Scale in flight fails fast; log its end, close the log."""
        self.thread.wait_for_scale(timeout_s)
        if self.log is not sys.stderr:
            self.log.close()
