"""A real Prometheus (Debian's `prometheus`) scrapes a gateway and 1P1D workers; every query of the
Grafana dashboard, evaluated by that Prometheus, returns data. This checks names as Prometheus
stores them: it negotiates OpenMetrics, where a colon in a name would come back escaped."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cluster_helpers import engine_argv, greedy_request, stub, tokens

from splitserve.common.serving import free_port
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

RESULTS_ENV = "SPLITSERVE_DASHBOARD_RESULTS"  # a file to write every query's result to
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "splitserve-dashboard.json"
SHARED = [(5 * j) % 300 + 1 for j in range(24)]  # three blocks of 8: later prompts hit them
PROMPTS = [SHARED + [(11 * i + j) % 300 + 1 for j in range(3 + 5 * i)] for i in range(6)] + [
    [(13 * i + j) % 300 + 1 for j in range(9 + 7 * i)] for i in range(4)
]


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def _start_prometheus(tmp_path: Path, targets: list[str]) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is not installed: run scripts/install-system-deps.sh")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"scrape_configs:\n  - job_name: splitserve\n    static_configs:\n      - targets: {json.dumps(targets)}\n"
    )
    address = f"127.0.0.1:{free_port()}"
    argv = [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
    argv += [f"--web.listen-address={address}"]
    with open(tmp_path / "prometheus.log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
    return proc, f"http://{address}"


def _wait(what: str, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if ready():
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def _targets_up(api: str, num_targets: int) -> bool:
    active = _get(f"{api}/api/v1/targets")["data"]["activeTargets"]
    return len(active) == num_targets and all(t["health"] == "up" for t in active)


def _query(api: str, expr: str) -> list[dict]:
    reply = _get(f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def _has_number(result: list[dict]) -> bool:
    """At least one series with a value that is a number (a quantile over no observations is NaN)."""
    return any(not math.isnan(float(r["value"][1])) for r in result)


def _dashboard() -> tuple[list[str], str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    (model,) = [v["query"] for v in board["templating"]["list"] if v["name"] == "model"]
    return exprs, model


@pytest.fixture()
def cluster(tiny_llama_dir):
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1)
    try:
        yield children
    finally:
        stop_cluster(children)


def test_every_dashboard_query_has_data_in_a_real_prometheus(cluster, tmp_path):
    proc, api = _start_prometheus(tmp_path, [c.metrics for c in cluster])
    try:
        _wait("prometheus to answer", lambda: urllib.request.urlopen(f"{api}/-/ready", timeout=2).status == 200, 20)
        _wait("every target to be up", lambda: _targets_up(api, len(cluster)), 20)
        gateway = stub(cluster[0].address)
        with ThreadPoolExecutor(4) as pool:  # concurrent, so that requests queue
            assert all(pool.map(lambda p: tokens(gateway, greedy_request(p, 12)), PROMPTS))
        exprs, model_query = _dashboard()
        assert model_query == "label_values(splitserve_num_requests_running, model_name)"
        models = _get(f"{api}/api/v1/label/model_name/values?match[]=splitserve_num_requests_running")["data"]
        assert len(models) == 1, models
        concrete = {e: e.replace("${model}", models[0]).replace("$model", models[0]) for e in exprs}
        assert not [e for e in concrete.values() if "$" in e], "a Grafana variable this test does not fill in"
        results: dict[str, list[dict]] = {}

        def all_answered() -> bool:
            results.update({e: _query(api, c) for e, c in concrete.items()})
            return all(_has_number(r) for r in results.values())

        try:
            _wait("every dashboard query to return data", all_answered, 15)
            if os.environ.get(RESULTS_ENV):  # docs/observability.md shows what a real Prometheus answered
                Path(os.environ[RESULTS_ENV]).write_text(json.dumps(results, indent=1))
        except AssertionError:
            empty = [e for e, r in results.items() if not _has_number(r)]
            pytest.fail(f"{len(empty)} of {len(exprs)} dashboard queries return no data:\n" + "\n".join(empty))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
