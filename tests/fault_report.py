"""What a fault-suite run (fault_harness.py) records, how it is judged and how it is shown: every
stream's outcome and every fault injected; the checks on outcomes and, after the load, on the live
processes (fault_harness.Cluster); the table `make soak` prints and its JSON."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import grpc
from cluster_helpers import load_is_idle, metric

from splitserve.gateway.generation import NO_WORKER, NOT_MOVED
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.launcher.launcher import wait_healthy

# Statuses a stream may end with, by what its client did. UNAVAILABLE: a worker died under it (or no
# pair was left); RESOURCE_EXHAUSTED: overload. Probes run after the faults stopped: only OK.
ALLOWED = {
    "normal": {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED"},
    "cancel": {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "CANCELLED"},
    "deadline": {"OK", "UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"},
    "probe": {"OK"},
}
# Worker errors that must not reach a client, not even inside the gateway's UNAVAILABLE message,
# which quotes the worker's status as "(CODE: details)" (gRPC's own connection errors say
# "last error: UNKNOWN: ..." without the parenthesis).
WORKER_BUGS = ("(UNKNOWN:", "(INTERNAL:")
DEADLINE_SLACK_S = 3.0  # client-side scheduling on a loaded 2-core machine


@dataclass(slots=True)
class Outcome:
    sender: str  # unique per stream: client and its request number ("c2-17"), or "probe-N"
    request_id: str  # the id it was sent with (now and then another client's)
    spec: int  # index into the workload
    kind: str  # normal | cancel | deadline | probe
    deadline_s: float
    start_s: float  # seconds on the run's clock (the log's time stamps)
    elapsed_s: float
    status: str  # gRPC status name
    details: str
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float  # seconds on the run's clock (the log's time stamps)
    kind: str
    worker: str = ""
    address: str = ""
    pid: int = 0
    detail: str = ""


@dataclass
class Report:
    label: str
    config: dict
    seconds: float = 0.0
    requests: int = 0
    faults: list[Fault] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    probes: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wrong_tokens: int = 0
    leaked_blocks: int = 0  # used blocks on live workers once everything settled
    held_blocks: int = 0
    held_requests: int = 0
    info: dict[str, float] = field(default_factory=dict)  # live workers' and the gateway's counters
    phases_s: dict[str, float] = field(default_factory=dict)  # where the run's time went
    tracebacks: dict[str, int] = field(default_factory=dict)  # "process: exception line" -> count

    def fault_counts(self) -> Counter:
        return Counter(f.kind for f in self.faults)

    def status_counts(self) -> Counter:
        return Counter(o.status for o in self.outcomes)


def check_outcomes(report: Report, want: list[list[int]], outcomes: list[Outcome]) -> None:
    for o in outcomes:
        expected = want[o.spec]
        wrong = o.tokens != expected if o.status == "OK" else o.tokens != expected[: len(o.tokens)]
        if wrong:
            report.wrong_tokens += 1
            report.failures.append(f"wrong tokens: {_describe(o)}\n  got  {o.tokens}\n  want {expected}")
        if o.status not in ALLOWED[o.kind]:
            report.failures.append(f"status {o.status} not allowed for a {o.kind} request: {_describe(o)}")
        elif o.status == "UNAVAILABLE" and any(code in o.details for code in WORKER_BUGS):
            report.failures.append(f"a worker error reached the client as UNAVAILABLE: {_describe(o)}")
        elif o.status == "UNAVAILABLE" and o.tokens and not any(why in o.details for why in (NOT_MOVED, NO_WORKER)):
            report.failures.append(f"a stream failed after tokens without moving (gateway migration): {_describe(o)}")
        if o.elapsed_s > o.deadline_s + DEADLINE_SLACK_S:
            report.failures.append(f"ran {o.elapsed_s:.1f} s past its {o.deadline_s} s deadline: {_describe(o)}")


def _describe(o: Outcome) -> str:
    return (
        f"{o.sender} (id {o.request_id}, workload {o.spec}, {o.kind}, deadline {o.deadline_s} s) started at "
        f"{o.start_s:.2f} s, took {o.elapsed_s:.2f} s, {o.status} {o.details!r}, {len(o.tokens)} tokens"
    )


def check_idle(
    cluster, report: Report, workers: list, timeout_s: float, when: str, tally: bool = True, slow_s: float | None = None
) -> None:
    """Every worker's pool all free, nothing running, waiting, awaiting KV or held (within timeout_s).
    slow_s: a worker still busy then but idle by timeout_s gets a note (what it held then, when it
    went idle), so a run that passes still says which waits were long."""
    start = time.monotonic()
    deadline, slow = start + timeout_s, {}
    while True:
        busy = {}
        for child in workers:
            try:
                r = cluster.load(child.address)
            except grpc.RpcError as e:
                busy[child.name] = (child, f"GetLoad failed: {e.code().name} {e.details()}")
                continue
            if not load_is_idle(r):
                busy[child.name] = (child, r)
        now = time.monotonic()
        if slow_s is not None and now - start > slow_s:
            for name, (_child, r) in busy.items():
                slow.setdefault(name, (now - start, _load_text(r)))
            for name in set(slow) - set(busy):
                seen_s, what = slow.pop(name)
                report.notes.append(f"{name} still busy {seen_s:.0f} s {when} ({what}); idle after {now - start:.1f} s")
        if not busy or now > deadline:
            break
        time.sleep(0.2)
    for child, r in busy.values():
        if isinstance(r, wpb.LoadReport) and tally:  # the table counts the first check's leaks only
            report.leaked_blocks += r.num_total_blocks - r.num_free_blocks
            report.held_blocks += r.num_held_blocks
            report.held_requests += r.num_held_requests
        tail = "\n  ".join(list(child.log)[-10:])
        report.failures.append(
            f"{child.name} ({child.mode}, {child.address}, pid {child.proc.pid}) not idle "
            f"{timeout_s:.0f} s {when}: {_load_text(r)}; its last lines:\n  {tail}"
        )


def _load_text(r: wpb.LoadReport | str) -> str:
    if not isinstance(r, wpb.LoadReport):
        return r
    return (
        f"free {r.num_free_blocks}/{r.num_total_blocks} blocks, running {r.num_running}, waiting "
        f"{r.num_waiting}, awaiting_kv {r.num_awaiting_kv}, held {r.num_held_blocks} blocks of "
        f"{r.num_held_requests} requests"
    )


def check_gateway(cluster, report: Report) -> None:
    """The gateway started first is still running, healthy, and counts no request in flight."""
    gateway = cluster.gateway
    if gateway.proc.poll() is not None or gateway.proc.pid != cluster.gateway_pid:
        report.failures.append(f"the gateway (pid {cluster.gateway_pid}) exited with {gateway.proc.returncode}")
        return
    try:
        wait_healthy(gateway.address, 5.0, gateway.proc)
    except (RuntimeError, TimeoutError) as e:
        report.failures.append(f"the gateway does not answer health checks: {e}")
    deadline = time.monotonic() + 5.0
    while True:  # the gateway's own count of requests in flight on each worker
        stuck = {w.address: w.outstanding for w in cluster.listed().values() if w.outstanding}
        if not stuck or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if stuck:
        report.failures.append(f"the gateway still counts requests in flight on workers: {stuck}")


def counters(cluster, workers: list) -> dict[str, float]:
    """Diagnostics for the table: live workers' counters (killed ones took theirs along), the gateway's."""

    def total(name: str, children, **labels) -> float:
        return sum(metric(c.metrics, name, **labels) for c in children)

    info = {
        "recompute fallbacks (live workers)": total("splitserve_kv_transfer_recompute_fallbacks_total", workers),
        "transfer failures (live workers)": total("splitserve_kv_transfer_failures_total", workers),
        "lease expiries (live workers)": total("splitserve_kv_lease_expiries_total", workers),
        "engine failed requests (live workers)": total("splitserve_engine_failed_requests_total", workers),
        "gateway retries": total("splitserve_gateway_retries_total", [cluster.gateway]),
        "streams moved (migrations)": total(
            "splitserve_gateway_migrations_total", [cluster.gateway], outcome="resumed"
        ),
    }
    for code in ("UNKNOWN", "INTERNAL"):
        info[f"gateway replies {code}"] = total("splitserve_gateway_requests_total", [cluster.gateway], code=code)
    return info


def format_table(reports: list[Report]) -> str:
    rows: list[tuple[str, list]] = [("run seconds", [r.seconds for r in reports])]
    for phase in reports[0].phases_s:
        rows.append((f"  {phase} s", [r.phases_s.get(phase, "") for r in reports]))
    rows.append(("requests", [r.requests for r in reports]))
    for kind in sorted(set().union(*(r.fault_counts() for r in reports))):
        rows.append((f"fault: {kind}", [r.fault_counts()[kind] for r in reports]))
    for status in sorted(set().union(*(r.status_counts() for r in reports))):
        rows.append((f"outcome: {status}", [r.status_counts()[status] for r in reports]))
    probes_ok = [f"{sum(p.status == 'OK' for p in r.probes)}/{len(r.probes)}" for r in reports]
    rows += [
        ("probes OK after faults", probes_ok),
        ("wrong tokens (must be 0)", [r.wrong_tokens for r in reports]),
        ("leaked blocks (must be 0)", [r.leaked_blocks for r in reports]),
        ("held blocks/requests (must be 0)", [f"{r.held_blocks}/{r.held_requests}" for r in reports]),
    ]
    for key in sorted(set().union(*(r.info for r in reports))):
        rows.append((key, [_number(r.info.get(key, "")) for r in reports]))
    rows += [
        (
            "slowest OK stream s",
            [max((o.elapsed_s for o in r.outcomes if o.status == "OK"), default=0) for r in reports],
        ),
        ("tracebacks in logs", [sum(r.tracebacks.values()) for r in reports]),
        ("FAILURES", [len(r.failures) for r in reports]),
    ]
    width = max(len(name) for name, _ in rows) + 2
    lines = [" " * width + "".join(f"{r.label:>12}" for r in reports)]
    lines += [name.ljust(width) + "".join(f"{str(v):>12}" for v in values) for name, values in rows]
    return "\n".join(lines)


def _number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def format_details(report: Report, max_failures: int = 20) -> str:
    lines = [f"== {report.label}: {len(report.failures)} failure(s)"]
    lines += [f"FAIL {f}" for f in report.failures[:max_failures]]
    if len(report.failures) > max_failures:
        lines.append(f"... and {len(report.failures) - max_failures} more (see the JSON)")
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"traceback x{n}: {where}" for where, n in sorted(report.tracebacks.items())]
    return "\n".join(lines)


def write_json(reports: list[Report], path: str) -> None:
    payload = [dict(asdict(r), fault_counts=r.fault_counts(), status_counts=r.status_counts()) for r in reports]
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def traceback_summary(lines: list[str]) -> dict[str, int]:
    """From "<t> [name] ..." log lines: "name: exception line" -> how often a traceback ended in it."""
    pending: set[str] = set()
    found: Counter = Counter()
    for line in lines:
        name, _, text = line.partition("] ")
        name = name.rsplit("[", 1)[-1]
        if text.startswith("Traceback (most recent call last)"):
            pending.add(name)
        elif (
            name in pending
            and text
            and not text[0].isspace()
            and not text.startswith(("During handling", "The above exception"))
        ):
            found[f"{name}: {text[:200]}"] += 1
            pending.discard(name)
    return dict(found)
