"""Every series the Grafana dashboard queries is one a splitserve process exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from splitserve.disagg.transfer.base import TransferFailure
from splitserve.gateway.server import GatewayMetrics
from splitserve.worker.metrics import EngineSnapshot, RequestTiming, WorkerMetrics

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "splitserve-dashboard.json"


def _exported() -> set[str]:
    worker = WorkerMetrics("m", "decode", lambda: EngineSnapshot(1, 2, 0.5, 0, 10, 5, 1))
    worker.observe_finished(RequestTiming(arrival=0.0, first_token=0.1, last_token=0.3, finished=0.3), 5, 3, "stop")
    worker.observe_token_gap(0.01)
    worker.observe_transfer("received", 2, 100, 0.01)
    worker.observe_transfer_failure(TransferFailure.TIMEOUT)
    worker.observe_blocks_skipped(1)
    worker.observe_recompute_fallback()
    gateway = GatewayMetrics()
    gateway.requests.labels(code="OK").inc()
    gateway.routed.labels(worker="w1", reason="disaggregated").inc()
    gateway.retries.labels(role="prefill").inc()
    gateway.prefix.lookups.labels(result="ok").inc()
    gateway.prefix.matched.observe(3)
    gateway.prefix.errors.labels(operation="lookup").inc()
    gateway.prefix.resyncs.inc()
    text = generate_latest(worker.registry).decode() + generate_latest(gateway.registry).decode()
    return set(re.findall(r"^(splitserve:[a-z_]+)", text, re.MULTILINE))


def test_dashboard_queries_only_exported_series():
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]
    wanted = {name for e in exprs for name in re.findall(r"splitserve:[a-z_]+", e)}
    missing = wanted - _exported()
    assert not missing, f"dashboard queries series nobody exports: {sorted(missing)}"
    assert len(wanted) >= 15
