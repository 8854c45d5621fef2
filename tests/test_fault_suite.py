"""The fault suite on real processes: a 2P2D cluster (in-memory prefix index, then Redis) under
concurrent load while workers are killed with SIGKILL and restarted, Redis stops and hangs, and
clients cancel streams, let short deadlines expire and reuse each other's request ids. What is checked
afterwards is listed at the top of fault_harness.py. A short run with a fixed seed; `make soak DURATION=600`
runs it longer."""

from __future__ import annotations

import pytest
from fault_harness import SoakConfig, run_soak
from fault_report import (
    Outcome,
    Report,
    check_outcomes,
    format_details,
    format_table,
    traceback_summary,
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


@pytest.mark.integration
@pytest.mark.parametrize(
    ("redis", "cores"),
    [(False, True), (True, True), (False, False)],
    ids=["memory-index", "redis-index", "memory-index-in-process"],
)
def test_2p2d_under_load_survives_kills_redis_loss_cancels_and_deadlines(tiny_llama_dir, tmp_path, redis, cores):
    """cores: every worker runs its step loop and KV handoffs in an engine core (the default; a killed
    worker's core must not outlive it); else in its serving process (--no-engine-process)."""
    log = tmp_path / "cluster.log"
    cfg = SoakConfig(model=str(tiny_llama_dir), seed=7, redis=redis, log_path=str(log), engine_process=cores)
    report = run_soak(cfg)
    write_json([report], str(tmp_path / "report.json"))
    print(format_table([report]))
    print(format_details(report))
    assert not report.failures, f"{format_details(report)}\nevery process's output: {log}"
    assert not _coverage_gaps(report), f"the run did not inject {_coverage_gaps(report)}: {report.fault_counts()}"


def _outcome(kind: str, status: str, tokens: list[int], details: str = "", elapsed_s: float = 0.1) -> Outcome:
    deadline_s = 1.0 if kind == "deadline" else 30.0
    return Outcome("c0-1", "c0-1", 0, kind, deadline_s, 0.0, elapsed_s, status, details, tokens)


@pytest.mark.unit
def test_the_checks_flag_what_they_must_and_nothing_else():
    want = [[5, 6, 7, 8]]
    fine = [
        _outcome("normal", "OK", [5, 6, 7, 8]),
        _outcome("cancel", "CANCELLED", [5, 6]),
        _outcome("deadline", "DEADLINE_EXCEEDED", []),
        _outcome("normal", "RESOURCE_EXHAUSTED", []),
        _outcome(
            "normal",
            "UNAVAILABLE",
            [5],
            "decode worker w1 failed during the request (UNAVAILABLE: failed "
            "to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused)",
        ),
    ]
    report = Report("unit", {})
    check_outcomes(report, want, fine)
    assert report.failures == [] and report.wrong_tokens == 0
    bad = [
        _outcome("normal", "OK", [5, 6, 7, 9]),
        _outcome("normal", "UNAVAILABLE", [6]),
        _outcome("normal", "CANCELLED", []),
        _outcome("normal", "DEADLINE_EXCEEDED", []),
        _outcome("cancel", "UNKNOWN", []),
        _outcome("probe", "UNAVAILABLE", []),
        _outcome("normal", "UNAVAILABLE", [], "decode worker w2 failed during the request (INTERNAL: boom)"),
        _outcome("deadline", "OK", [5, 6, 7, 8], elapsed_s=9.0),
    ]
    check_outcomes(report, want, bad)
    assert report.wrong_tokens == 2 and len(report.failures) == len(bad)
    lines = [
        "1.0 [decode-0] Traceback (most recent call last):",
        "1.0 [gateway] INFO ok",
        '1.1 [decode-0]   File "x"',
        "1.1 [decode-0] RuntimeError: engine step failed",
    ]
    assert traceback_summary(lines) == {"decode-0: RuntimeError: engine step failed": 1}
