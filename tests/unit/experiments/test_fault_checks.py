"""The fault suite's checks (tests/fault_report.py) on made-up outcomes: they flag a wrong token,
a lost request or a leaked block, and nothing that a fault explains (the suite itself:
tests/integration/test_fault_suite.py)."""

from __future__ import annotations

from fault_report import (
    Outcome,
    Report,
    check_outcomes,
    traceback_summary,
)

from splitserve.gateway.generation import NOT_MOVED

# What the gateway says of a worker that failed (here: killed) during a request.
KILLED = (
    "decode worker w1 failed during the request (UNAVAILABLE: failed "
    "to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused)"
)


def _outcome(kind: str, status: str, tokens: list[int], details: str = "", elapsed_s: float = 0.1) -> Outcome:
    deadline_s = 1.0 if kind == "deadline" else 30.0
    return Outcome("c0-1", "c0-1", 0, kind, deadline_s, 0.0, elapsed_s, status, details, tokens)


def test_the_checks_flag_what_they_must_and_nothing_else():
    want = [[5, 6, 7, 8]]
    fine = [
        _outcome("normal", "OK", [5, 6, 7, 8]),
        _outcome("cancel", "CANCELLED", [5, 6]),
        _outcome("deadline", "DEADLINE_EXCEEDED", []),
        _outcome("normal", "RESOURCE_EXHAUSTED", []),
        _outcome("normal", "UNAVAILABLE", [], KILLED),  # before any token: its retries were spent
        _outcome("normal", "UNAVAILABLE", [5], f"{KILLED}; {NOT_MOVED}"),  # its migrations were spent
    ]
    report = Report("unit", {})
    check_outcomes(report, want, fine)
    assert report.failures == [] and report.wrong_tokens == 0
    bad = [
        _outcome("normal", "OK", [5, 6, 7, 9]),
        _outcome("normal", "UNAVAILABLE", [6], NOT_MOVED),
        _outcome("normal", "UNAVAILABLE", [5], KILLED),  # tokens went out, and the stream did not move
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
