"""`splitserve experiment CONFIG`: start each deployment (or reach a running OpenAI-compatible server),
warm it up, sweep request rates (and workloads), stop it; write a report folder: runs.json, PNG plots,
summary.md.

Config (TOML; examples in experiments/configs/):

    name = "cpu-smollm2"
    engine_args = ["--kv-cache-bytes", "268435456"]   # passed to every worker
    warmup_requests = 2
    [[slos]]                       # goodput is computed for each; the summary names a winner per SLO
    name = "interactive"; ttft_ms = 2000; tpot_ms = 150
    [[deployments]]
    name = "unified x1"; workers = 1
    [[deployments]]
    name = "1P1D"; prefill = 1; decode = 1; pin_cpus = true   # each worker on its own cores
    [[deployments]]                # a server already running: only sent to (API key: OPENAI_API_KEY)
    name = "vllm"; endpoint = "http://127.0.0.1:8000"; api = "completions"   # or "chat"
    [sweep]
    rates = [0.5, 1.0, 2.0]        # requests/s, Poisson arrivals
    [[workloads]]                  # WorkloadConfig fields; lengths as "N", "uniform:LO:HI", "normal:M:S"
    name = "chat"; num_requests = 16; prompt_len = "uniform:64:256"; output_len = "32"
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import tomllib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from splitserve.experiments.bench import measure
from splitserve.experiments.loadgen import ENDPOINTS, Connect, OpenAIConfig, grpc_connect
from splitserve.experiments.stats import SLO, summarize
from splitserve.experiments.workload import LengthDist, WorkloadConfig
from splitserve.launch.launcher import Child, start_cluster, stop_cluster


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

    def __post_init__(self) -> None:
        if self.endpoint is not None and self.num_workers:
            raise ValueError(f"deployment {self.name!r}: give an endpoint or a cluster shape, not both")
        if self.endpoint is None and not self.num_workers:
            raise ValueError(f"deployment {self.name!r}: give workers = N, prefill + decode, or an endpoint")
        if self.api not in (None, "grpc", *ENDPOINTS):
            raise ValueError(f"deployment {self.name!r}: api must be grpc, completions or chat, got {self.api!r}")
        if self.endpoint is not None and self.api == "grpc":
            raise ValueError(f"deployment {self.name!r}: an endpoint is reached with api = completions or chat")

    @property
    def num_workers(self) -> int:
        return self.workers + self.prefill + self.decode

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
class ExperimentConfig:
    name: str
    deployments: tuple[Deployment, ...]
    workloads: tuple[tuple[str, WorkloadConfig], ...]
    rates: tuple[float, ...]
    slos: tuple[tuple[str, SLO], ...] = (("none", SLO()),)
    engine_args: tuple[str, ...] = ()
    warmup_requests: int = 2
    settings: dict = field(default_factory=dict)  # the raw config, recorded in the report


def load_config(path: str | Path) -> ExperimentConfig:
    raw = tomllib.loads(Path(path).read_text())
    try:
        deployments = tuple(
            Deployment(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})  # type: ignore[arg-type]
            for d in raw["deployments"]
        )
        workloads = tuple(
            (w.pop("name", f"workload-{i}"), _workload(w))
            for i, w in enumerate(dict(w) for w in raw.get("workloads", [{}]))
        )
        slos = tuple((s.pop("name", f"slo-{i}"), SLO(**s)) for i, s in enumerate(dict(s) for s in raw.get("slos", [])))
        rates = tuple(float(r) for r in raw["sweep"]["rates"])
    except (KeyError, TypeError) as e:
        raise ValueError(
            f"{path}: bad experiment config ({e!r}); see the docstring of "
            "splitserve/experiments/experiment.py or experiments/configs/"
        ) from None
    if not deployments or not rates:
        raise ValueError(f"{path}: needs at least one [[deployments]] and [sweep] rates")
    return ExperimentConfig(
        raw.get("name", Path(path).stem),
        deployments,
        workloads,
        rates,
        slos or (("none", SLO()),),
        tuple(raw.get("engine_args", ())),
        int(raw.get("warmup_requests", 2)),
        raw,
    )


def _workload(fields: dict) -> WorkloadConfig:
    for key in ("prompt_len", "output_len"):
        if key in fields:
            fields[key] = LengthDist.parse(str(fields[key]))
    return WorkloadConfig(**fields)


def cpu_sets(num_workers: int) -> list[str]:
    """Disjoint core sets, one per worker (shared round robin when workers outnumber cores)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // num_workers)
    return [
        ",".join(map(str, cores[(i * per) % len(cores) : (i * per) % len(cores) + per])) for i in range(num_workers)
    ]


def run_deployment(cfg: ExperimentConfig, dep: Deployment) -> list[dict]:
    if dep.endpoint is not None:
        return sweep(cfg, dep, dep.connect(None), None)
    pinning = cpu_sets(dep.num_workers) if dep.pin_cpus else None
    children = start_cluster(
        dep.workers,
        list(cfg.engine_args),
        num_prefill=dep.prefill,
        num_decode=dep.decode,
        worker_argv=list(dep.worker_args),
        gateway_argv=list(dep.gateway_args),
        worker_cpus=pinning,
        devices=list(dep.devices) or None,
    )
    try:
        return sweep(cfg, dep, dep.connect(children[0]), pinning)
    finally:
        stop_cluster(children)


def sweep(cfg: ExperimentConfig, dep: Deployment, connect: Connect, pinning: list[str] | None) -> list[dict]:
    """Warm the deployment up, then run every workload at every rate."""
    _, first_workload = cfg.workloads[0]
    warmup = replace(
        first_workload,
        num_requests=cfg.warmup_requests,
        arrival="concurrency",
        concurrency=1,
        duration_s=None,
        seed=first_workload.seed + 999_999,
    )
    asyncio.run(measure(connect, warmup, SLO(), show_progress=False))
    runs = []
    for workload_name, workload in cfg.workloads:
        for i, rate in enumerate(cfg.rates):
            print(f"[experiment] {dep.name} / {workload_name} / {rate} req/s", flush=True)
            # Fresh prompts per rate: repeating them would turn later rates into prefix-cache hits.
            run_workload = replace(workload, rate=rate, seed=workload.seed + 1000 * (i + 1))
            summary, records = asyncio.run(measure(connect, run_workload, SLO()))
            goodput = {name: summarize(records, summary.duration_s, slo).goodput for name, slo in cfg.slos}
            runs.append(
                {
                    "deployment": dep.name,
                    "workload": workload_name,
                    "rate": rate,
                    "api": dep.protocol,
                    "endpoint": dep.endpoint,
                    "cpu_sets": pinning,
                    "summary": summary.to_dict(),
                    "goodput": goodput,
                    "records": [asdict(r) for r in records],
                }
            )
    return runs


def run_experiment(cfg: ExperimentConfig, out: Path) -> list[dict]:
    from splitserve.experiments.plots import write_plots
    from splitserve.experiments.summary import write_summary

    out.mkdir(parents=True, exist_ok=True)
    runs = [run for dep in cfg.deployments for run in run_deployment(cfg, dep)]
    settings = {
        "config": cfg.settings,
        "cpus": sorted(os.sched_getaffinity(0)),
        "slos": {name: asdict(slo) for name, slo in cfg.slos},
    }
    (out / "runs.json").write_text(json.dumps({"settings": settings, "runs": runs}, indent=1))
    write_plots(runs, cfg, out)
    write_summary(runs, cfg, out)
    return runs


def run_experiment_file(path: str, out: str | None) -> int:
    cfg = load_config(path)
    folder = Path(out) if out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_experiment(cfg, folder)
    print(f"report: {folder}/summary.md (plots and runs.json beside it)")
    return 0
