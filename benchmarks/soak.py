"""`make soak DURATION=600`: the fault suite of tests/integration/test_fault_suite.py run longer (one harness,
tests/fault_harness.py). A 2P2D cluster on the tiny test model, with the in-memory prefix index and
then with Redis, under concurrent load while workers are killed and restarted, Redis stops and
hangs, and clients cancel and let deadlines expire. Prints a table (requests, faults by kind,
outcomes by status, wrong tokens, leaked blocks, ...) and every failure; writes the JSON report and
each run's full process log. Exits 1 if any check failed.

Usage: python benchmarks/soak.py [--duration 300] [--index both|memory|redis] [--seed 0]
       [--json runs/soak/soak.json] [--kill-interval 3] [--clients 4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import _save_tiny  # noqa: E402  (the tiny model the tests use)
from fault_harness import SoakConfig, run_soak  # noqa: E402
from fault_report import format_details, format_table, write_json  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load and faults per variant")
    p.add_argument("--index", choices=["both", "memory", "redis"], default="both", help="prefix index backend(s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads")
    p.add_argument("--kill-interval", type=float, default=3.0, help="mean seconds between worker kills")
    p.add_argument("--json", default="runs/soak/soak.json", help="report path (the logs go beside it)")
    a = p.parse_args(argv)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    variants = {"both": [False, True], "memory": [False], "redis": [True]}[a.index]
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        model = str(_save_tiny(Path(tmp), "llama"))
        for redis in variants:
            log = out.parent / f"soak-{'redis' if redis else 'memory'}.log"
            print(
                f"soak: {'redis' if redis else 'memory'} index, {a.duration:.0f} s, seed {a.seed}; log {log}",
                flush=True,
            )
            cfg = SoakConfig(
                model=model,
                duration_s=a.duration,
                seed=a.seed,
                redis=redis,
                num_clients=a.clients,
                kill_interval_s=a.kill_interval,
                log_path=str(log),
            )
            reports.append(run_soak(cfg))
    print(format_table(reports))
    for report in reports:
        print(format_details(report))
    write_json(reports, str(out))
    print(f"report: {out}")
    return 1 if any(r.failures for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
