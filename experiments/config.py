"""An experiment's TOML config: deployments, SLOs, workloads, the rate sweep (repeats, run length,
measurement window), the goodput search, and the P:D sweep at a fixed worker budget.

    name = "cpu-smollm2"
    engine_args = ["--kv-cache-bytes", "268435456"]   # passed to every worker
    warmup_requests = 2                               # sent once per deployment before any run
    [[slos]]
    name = "interactive"; ttft_ms = 1500; tpot_ms = 120; attainment = 0.9   # target share meeting both
    [[deployments]]
    name = "unified x1"; workers = 1
    [[deployments]]
    name = "1P1D"; prefill = 1; decode = 1; pin_cpus = true   # each worker on its own cores
    [[deployments]]                # sized by the SLO planner in process, from its minimum (fleet.py)
    name = "planner"
    [deployments.autoscale]        # `splitserve planner`'s policy options, underscored
    ttft_ms = 3000; itl_ms = 200; min_prefill = 1; max_prefill = 2; budget = 3; interval_s = 3
    [[deployments]]                # a server already running: only sent to (API key: OPENAI_API_KEY)
    name = "vllm"; endpoint = "http://127.0.0.1:8000"; api = "completions"; gpus = 1   # goodput / gpus
    [sweep]
    rates = [0.5, 1.0, 2.0]        # offered requests/s (Poisson arrivals)
    repeats = 3                    # runs per rate (fresh prompts each), for confidence intervals
    duration_s = 60                # size each run by time (else each workload's num_requests)
    warmup_s = 10                  # requests sent in the first 10 s and ...
    cooldown_s = 10                # ... the last 10 s are sent but not counted
    interval = "t"                 # or "bootstrap"
    [goodput]                      # DistServe's goodput: search beyond the grid (goodput.py)
    tolerance = 0.1; max_probes = 4
    [pd_sweep]                     # unified x2, 1P1D at each prompt:output length ratio: a heat map
    budget = 2; prompt_output_ratios = [1, 4, 16]; pin_cpus = true
    [[workloads]]                  # WorkloadConfig fields; lengths as "N", "uniform:LO:HI", "normal:M:S"
    name = "chat"; num_requests = 16; prompt_len = "uniform:64:256"; output_len = "32"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from splitserve.experiments.goodput import SearchConfig
from splitserve.experiments.intervals import METHODS
from splitserve.experiments.loadgen import ENDPOINTS, Connect, OpenAIConfig, grpc_connect
from splitserve.experiments.stats import SLO, Window
from splitserve.experiments.workload import LengthDist, WorkloadConfig
from splitserve.services.launcher.autoscale import AutoscaleSettings
from splitserve.services.launcher.launcher import Child
from splitserve.services.planner.cli import policy_args_from_table

Workloads = tuple[tuple[str, WorkloadConfig], ...]  # (name, workload) in config order


@dataclass(frozen=True, slots=True)
class Deployment:
    """A cluster shape the experiment starts (workers, or prefill + decode), or a running server it
    only sends to (endpoint: an OpenAI-compatible base URL, e.g. vLLM or SGLang on the same host)."""

    name: str
    workers: int = 0
    prefill: int = 0
    decode: int = 0
    pin_cpus: bool = False
    devices: tuple[str, ...] = ()  # spread workers over these devices round robin, e.g. ("cuda:0", "cuda:1")
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    endpoint: str | None = None  # a running server's base URL: nothing is started or stopped
    api: str | None = None  # grpc | completions | chat; default: grpc for a cluster, completions for an endpoint
    model: str | None = None  # endpoint / HTTP API: the model to ask for (default: the first /v1/models lists)
    ignore_eos: bool = True  # HTTP API: send ignore_eos (false for servers that reject unknown fields)
    gpus: int = 0  # what goodput per worker divides by, when not the workers started (an endpoint's GPUs)
    autoscale: AutoscaleSettings | None = None  # the planner sizes it, from its minimum (the shape above)

    def __post_init__(self) -> None:
        self._check_autoscale()
        if self.endpoint is not None and self.num_workers:
            raise ValueError(f"deployment {self.name!r}: give an endpoint or a cluster shape, not both")
        if self.endpoint is None and not self.num_workers:
            raise ValueError(f"deployment {self.name!r}: give workers = N, prefill + decode, or an endpoint")
        if self.api not in (None, "grpc", *ENDPOINTS):
            raise ValueError(f"deployment {self.name!r}: api must be grpc, completions or chat, got {self.api!r}")
        if self.endpoint is not None and self.api == "grpc":
            raise ValueError(f"deployment {self.name!r}: an endpoint is reached with api = completions or chat")
        if min(self.workers, self.prefill, self.decode, self.gpus) < 0:
            raise ValueError(f"deployment {self.name!r}: worker and GPU counts must be >= 0")

    def _check_autoscale(self) -> None:
        if self.autoscale is None:
            return
        if self.endpoint is not None or self.pin_cpus:
            raise ValueError(f"deployment {self.name!r}: an autoscaled deployment is started here, unpinned")
        if self.tier_counts() != {role.value: n for role, n in self.autoscale.minimum().items()}:
            raise ValueError(f"deployment {self.name!r}: an autoscaled deployment starts at the planner's minimum")

    @property
    def num_workers(self) -> int:
        return self.workers + self.prefill + self.decode

    @property
    def budget(self) -> int:
        """The workers (or GPUs) this deployment spends: goodput per worker divides by it, so 1P1D is
        compared with one unified worker and with two on equal terms. An endpoint counts 1 unless
        `gpus` says otherwise; an autoscaled deployment, the planner's budget (the most it may start:
        goodput per worker-second counts the workers it did run)."""
        if self.autoscale is not None:
            return self.autoscale.config.bounds.budget
        return self.gpus or self.num_workers or 1

    def tier_counts(self) -> dict[str, int]:
        """Workers per tier as started (an endpoint: {"endpoint": its budget})."""
        if self.endpoint is not None:
            return {"endpoint": self.budget}
        counts = (("unified", self.workers), ("prefill", self.prefill), ("decode", self.decode))
        return {tier: n for tier, n in counts if n}

    @property
    def protocol(self) -> str:
        return self.api or ("completions" if self.endpoint is not None else "grpc")

    def connect(self, gateway: Child | None) -> Connect:
        """The client for this deployment: to the endpoint, or to the started gateway's gRPC or HTTP API."""
        if gateway is None:  # an endpoint deployment (so endpoint is set, and api is completions or chat)
            return self._openai(str(self.endpoint))
        if self.protocol == "grpc":
            return grpc_connect(gateway.address)
        return self._openai(f"http://{gateway.http}")

    def _openai(self, base_url: str) -> Connect:
        return OpenAIConfig(base_url, self.protocol, self.model, ignore_eos=self.ignore_eos).connect


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """[sweep]: the offered rates, how many runs per rate, how long each, and what each counts."""

    rates: tuple[float, ...]
    repeats: int = 1
    duration_s: float | None = None  # size runs by time (Poisson/burst); None: each workload's num_requests
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    interval: str = "t"  # confidence intervals over repeats: "t" or "bootstrap" (intervals.py)

    def __post_init__(self) -> None:
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"[sweep] rates must be positive request rates, got {list(self.rates)}")
        if self.repeats < 1:
            raise ValueError(f"[sweep] repeats must be >= 1, got {self.repeats}")
        if self.interval not in METHODS:
            raise ValueError(f"[sweep] interval must be one of {sorted(METHODS)}, got {self.interval!r}")
        if self.duration_s is not None and self.duration_s <= self.warmup_s + self.cooldown_s:
            raise ValueError(
                f"[sweep] duration_s {self.duration_s} leaves nothing to count after warmup_s {self.warmup_s} "
                f"and cooldown_s {self.cooldown_s}"
            )
        Window(self.warmup_s, self.cooldown_s)  # negative values fail here, before anything starts

    @property
    def window(self) -> Window:
        return Window(self.warmup_s, self.cooldown_s)


@dataclass(frozen=True, slots=True)
class PDSweep:
    """[pd_sweep]: every split of a fixed worker budget (unified xN, and each xPyD with x + y = N), each
    sent one workload per prompt/output length ratio: the base workload with its prompt lengths scaled so
    the mean prompt is `ratio` times the mean output (outputs, so decode work per request, stay)."""

    budget: int
    prompt_output_ratios: tuple[float, ...]
    workload: str | None = None  # the [[workloads]] entry to rescale (default: the first)
    pin_cpus: bool = False
    devices: tuple[str, ...] = ()
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    api: str | None = None

    def __post_init__(self) -> None:
        if self.budget < 2:
            raise ValueError(f"[pd_sweep] budget must be >= 2 workers (1P1D needs two), got {self.budget}")
        if not self.prompt_output_ratios or min(self.prompt_output_ratios) <= 0:
            raise ValueError("[pd_sweep] prompt_output_ratios must be positive, e.g. [1, 4, 16]")

    def layouts(self) -> tuple[Deployment, ...]:
        """unified xN, then 1P(N-1)D ... (N-1)P1D."""
        unified = Deployment(
            f"unified x{self.budget}",
            workers=self.budget,
            pin_cpus=self.pin_cpus,
            devices=self.devices,
            worker_args=self.worker_args,
            gateway_args=self.gateway_args,
            api=self.api,
        )
        splits = (
            replace(unified, name=f"{p}P{self.budget - p}D", workers=0, prefill=p, decode=self.budget - p)
            for p in range(1, self.budget)
        )
        return (unified, *splits)

    def workloads(self, base_name: str, base: WorkloadConfig) -> Workloads:
        if base.trace is not None:
            raise ValueError(f"[pd_sweep] rescales sampled lengths; workload {base_name!r} replays a trace")
        return tuple((f"{base_name} {r:g}:1", _with_ratio(base, r)) for r in self.prompt_output_ratios)


def _mean(dist: LengthDist) -> float:
    return (dist.a + dist.b) / 2 if dist.kind == "uniform" else dist.a  # fixed: a; normal: mean a


def _scaled(dist: LengthDist, scale: float) -> LengthDist:
    """The distribution with its lengths (and a normal's stddev) times scale, at least one token."""
    a = max(1, round(dist.a * scale))
    if dist.kind == "fixed":
        return LengthDist("fixed", a)
    b = round(dist.b * scale)
    return LengthDist(dist.kind, a, max(a, b) if dist.kind == "uniform" else b)


def _with_ratio(base: WorkloadConfig, ratio: float) -> WorkloadConfig:
    scale = ratio * _mean(base.output_len) / _mean(base.prompt_len)
    return replace(base, prompt_len=_scaled(base.prompt_len, scale))


@dataclass(frozen=True, slots=True)
class ExperimentConfig:
    name: str
    deployments: tuple[Deployment, ...]
    workloads: Workloads
    sweep: SweepConfig
    slos: tuple[tuple[str, SLO], ...] = (("none", SLO()),)
    engine_args: tuple[str, ...] = ()
    warmup_requests: int = 2
    search: SearchConfig = SearchConfig()
    pd_sweep: PDSweep | None = None
    settings: dict = field(default_factory=dict)  # the raw config, recorded in the report

    def __post_init__(self) -> None:
        if not self.workloads:
            raise ValueError("an experiment needs at least one workload")
        if not self.deployments and self.pd_sweep is None:
            raise ValueError("an experiment needs [[deployments]] or a [pd_sweep]")
        self.plan()  # clashing names fail at load, not an hour in

    @property
    def rates(self) -> tuple[float, ...]:
        return self.sweep.rates

    def autoscaled(self) -> list[str]:
        """The names of the deployments the planner sizes."""
        return [d.name for d in self.deployments if d.autoscale is not None]

    def pd_workloads(self) -> Workloads:
        if self.pd_sweep is None:
            return ()
        names = dict(self.workloads)
        base_name = self.pd_sweep.workload or self.workloads[0][0]
        if base_name not in names:
            raise ValueError(f"[pd_sweep] workload {base_name!r} is not a [[workloads]] name ({sorted(names)})")
        return self.pd_sweep.workloads(base_name, names[base_name])

    def plan(self) -> tuple[tuple[Deployment, Workloads], ...]:
        """Each deployment to start (once) and the workloads it runs: every [[deployments]] entry runs every
        [[workloads]] entry; each pd_sweep layout runs the ratio workloads (both, if it is also listed)."""
        planned: dict[str, tuple[Deployment, Workloads]] = {d.name: (d, self.workloads) for d in self.deployments}
        if len(planned) != len(self.deployments):
            raise ValueError("deployment names must be distinct")
        layouts = self.pd_sweep.layouts() if self.pd_sweep else ()
        for layout in layouts:
            listed, workloads = planned.get(layout.name, (layout, ()))
            if listed != layout:
                raise ValueError(
                    f"[pd_sweep] layout {layout.name!r} differs from the [[deployments]] entry of that name: "
                    "rename the entry, or give it the pd_sweep's settings"
                )
            planned[layout.name] = (layout, workloads + self.pd_workloads())
        return tuple(planned.values())


def load_config(path: str | Path) -> ExperimentConfig:
    raw = tomllib.loads(Path(path).read_text())
    try:
        return ExperimentConfig(
            raw.get("name", Path(path).stem),
            tuple(_deployment(d, Path(path).parent) for d in raw.get("deployments", [])),
            tuple(
                (w.pop("name", f"workload-{i}"), _workload(w, Path(path).parent))
                for i, w in enumerate(dict(w) for w in raw.get("workloads", [{}]))
            ),
            _sweep(raw["sweep"]),
            tuple((s.pop("name", f"slo-{i}"), SLO(**s)) for i, s in enumerate(dict(s) for s in raw.get("slos", [])))
            or (("none", SLO()),),
            tuple(raw.get("engine_args", ())),
            int(raw.get("warmup_requests", 2)),
            # Without a [goodput] table the goodput is read off the grid; with one, the search probes more.
            SearchConfig(**raw["goodput"]) if "goodput" in raw else SearchConfig(max_probes=0),
            PDSweep(**_tuples(raw["pd_sweep"])) if "pd_sweep" in raw else None,
            raw,
        )
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: bad experiment config ({e!r}); see splitserve/experiments/config.py or experiments/configs/"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _deployment(table: dict, config_dir: Path) -> Deployment:
    """A [[deployments]] entry; one with an autoscale table starts at the planner's minimum."""
    fields = _tuples(table)
    if "autoscale" not in fields:
        return Deployment(**fields)
    if {"workers", "prefill", "decode"} & fields.keys():
        raise ValueError(
            f"deployment {fields.get('name')!r}: an autoscaled deployment starts at the planner's minimum; "
            "leave out workers, prefill and decode (min_prefill, min_decode or min_workers set it)"
        )
    options = dict(fields["autoscale"])
    profile = options.get("profile")
    if profile is not None and not Path(profile).is_absolute() and not Path(profile).exists():
        options["profile"] = str(config_dir / profile)  # relative to the config file, as a trace is
    settings = AutoscaleSettings.from_args(policy_args_from_table(options))
    shape = {"workers" if role.value == "unified" else role.value: n for role, n in settings.minimum().items()}
    return Deployment(**(fields | shape | {"autoscale": settings}))


def _sweep(table: dict) -> SweepConfig:
    # Rates as floats: TOML's `rates = [2, 4]` are ints, and a run's seed and JSON record take the rate as given.
    return SweepConfig(**_tuples(table) | {"rates": tuple(float(r) for r in table["rates"])})


def _tuples(table: dict) -> dict:
    """TOML arrays as tuples (frozen dataclasses hold tuples)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in table.items()}


def _workload(fields: dict, config_dir: Path) -> WorkloadConfig:
    for key in ("prompt_len", "output_len"):
        if key in fields:
            fields[key] = LengthDist.parse(str(fields[key]))
    trace = fields.get("trace")
    if trace is not None and not Path(trace).is_absolute() and not Path(trace).exists():
        fields["trace"] = str(config_dir / trace)  # relative to the config file, when not to the current folder
    return WorkloadConfig(**fields)
