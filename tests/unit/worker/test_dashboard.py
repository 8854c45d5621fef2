"""Every series the Grafana dashboard queries is one a splitserve process exports, under the same
name in both exposition formats (tests/integration/test_prometheus.py runs the queries in a real Prometheus)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from splitserve.gateway.server import GatewayMetrics
from splitserve.services.disagg.metrics import KVTransferMetrics
from splitserve.services.disagg.transfer.base import TransferFailure
from splitserve.services.worker.metrics import CoreMetrics, EngineSnapshot, RequestTiming, WorkerMetrics, metric_labels

NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
DASHBOARD = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "splitserve-dashboard.json"


def _names(text: str) -> set[str]:
    return set(re.findall(rf"^({NAME})[{{ ]", text, re.MULTILINE))


def _exported(exposition=generate_latest) -> set[str]:
    worker = WorkerMetrics("m", "decode", lambda: EngineSnapshot(1, 2, 0.5, 0, 10, 5, 1))
    worker.observe_finished(RequestTiming(arrival=0.0, first_token=0.1, last_token=0.3, finished=0.3), 5, 3, "stop")
    worker.observe_token_gap(0.01)
    core = CollectorRegistry()  # the engine core's, read back and exported by the worker's registry
    kv = KVTransferMetrics(metric_labels("m", "decode"), "decode", core)
    kv.observe_transfer("received", 2, 100, 0.01)
    kv.observe_transfer_failure(TransferFailure.TIMEOUT)
    kv.observe_blocks_skipped(1)
    kv.observe_recompute_fallback()
    worker.registry.register(CoreMetrics(lambda: generate_latest(core)))
    gateway = GatewayMetrics()
    gateway.requests.labels(code="OK").inc()
    gateway.routed.labels(worker="w1", reason="disaggregated").inc()
    gateway.retries.labels(role="prefill").inc()
    gateway.prefix.lookups.labels(result="ok").inc()
    gateway.prefix.matched.observe(3)
    gateway.prefix.errors.labels(operation="lookup").inc()
    gateway.prefix.resyncs.inc()
    return _names(exposition(worker.registry).decode()) | _names(exposition(gateway.registry).decode())


def test_names_are_the_same_in_both_exposition_formats():
    """A colon is escaped in OpenMetrics, the format Prometheus asks for: no name may have one."""
    text_format = _exported()
    assert not [n for n in text_format if ":" in n]
    assert all(n.startswith("splitserve_") for n in text_format), sorted(text_format)
    assert _exported(generate_openmetrics) == text_format


def test_dashboard_queries_only_exported_series():
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    wanted = {name for e in exprs for name in re.findall(r"\bsplitserve[a-zA-Z0-9_:]*", e)}
    missing = wanted - _exported()
    assert not missing, f"dashboard queries series nobody exports: {sorted(missing)}"
    assert len(wanted) >= 15
