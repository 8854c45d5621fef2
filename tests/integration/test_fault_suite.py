"""The fault suite on real processes: a 2P2D cluster (in-memory prefix index, then Redis) under
concurrent load while workers are killed with SIGKILL and restarted, Redis stops and hangs, and
clients cancel streams, let short deadlines expire and reuse each other's request ids. What is checked
afterwards is listed at the top of fault_harness.py. A short run with a fixed seed; `make soak DURATION=600`
runs it longer."""

from __future__ import annotations

import pytest
from fault_harness import SoakConfig, run_soak
from fault_report import (
    Report,
    format_details,
    format_table,
    write_json,
)


def _coverage_gaps(report: Report) -> list[str]:
    """What the run was meant to inject but did not: a pass would then prove less than it says."""
    faults, kinds = report.fault_counts(), {o.kind for o in report.outcomes}
    wanted = {
        "a prefill kill": any(k.startswith("kill prefill") for k in faults),
        "a decode kill": any(k.startswith("kill decode") for k in faults),
        "two restarts": sum(n for k, n in faults.items() if k.startswith("restart")) >= 2,
        "cancelled and short-deadline requests": {"cancel", "deadline"} <= kinds,
        "a reused request id": any(o.sender != o.request_id for o in report.outcomes),
        "20 streams that ended OK": report.status_counts()["OK"] >= 20,
    }
    if report.label.startswith("redis"):
        wanted["a Redis fault"] = any(k.startswith("redis") for k in faults)
    return [name for name, seen in wanted.items() if not seen]


@pytest.mark.parametrize("redis", [False, True], ids=["memory-index", "redis-index"])
def test_2p2d_under_load_survives_kills_redis_loss_cancels_and_deadlines(tiny_llama_dir, tmp_path, redis):
    """Every worker runs its step loop and KV handoffs in an engine core (a killed worker's core must
    not outlive it)."""
    log = tmp_path / "cluster.log"
    cfg = SoakConfig(model=str(tiny_llama_dir), seed=7, redis=redis, log_path=str(log))
    report = run_soak(cfg)
    write_json([report], str(tmp_path / "report.json"))
    print(format_table([report]))
    print(format_details(report))
    assert not report.failures, f"{format_details(report)}\nevery process's output: {log}"
    assert not _coverage_gaps(report), f"the run did not inject {_coverage_gaps(report)}: {report.fault_counts()}"
