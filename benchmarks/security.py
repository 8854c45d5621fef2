"""Serving throughput with everything secured vs plaintext, in one run (issue target: >= 0.9x).

Two 1P1D clusters of the bundled SmolLM2 on CPU, started side by side: one plaintext and open, one
with public TLS + client certificates, API keys, cluster mTLS and the join secret (certificates
made here by services/launcher/certs.py). The same workload (every request sent at once) goes through each
in turn, alternating, --rounds times; the idle cluster uses no CPU while the other is measured.

Usage: python benchmarks/security.py [--rounds 3] [--num-requests 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from splitserve.common.security import PLAINTEXT_GATEWAY, GatewayCredentials
from splitserve.experiments.loadgen import send_workload
from splitserve.experiments.workload import LengthDist, WorkloadConfig
from splitserve.services.launcher.certs import SecureBundle, make_bundle
from splitserve.services.launcher.launcher import Child, start_cluster, stop_cluster

WORKER_ARGV = ["--kv-cache-bytes", str(512 * 1024**2), "--num-threads", "1"]


def _secure_cluster(bundle: SecureBundle) -> tuple[list[Child], GatewayCredentials]:
    children = start_cluster(
        0,
        WORKER_ARGV + bundle.worker_argv(),
        num_prefill=1,
        num_decode=1,
        gateway_argv=bundle.gateway_argv() + ["--tls-client-ca", str(bundle.ca_cert)],
        cluster=bundle.cluster(),
    )
    return children, GatewayCredentials(str(bundle.ca_cert), bundle.api_key, bundle.client_identity())


def _throughput(children: list[Child], credentials: GatewayCredentials, workload: WorkloadConfig) -> float:
    records, seconds = send_workload(children[0].address, workload, timeout_s=1800, credentials=credentials)
    return sum(r.output_tokens for r in records) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args()
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        arrival="burst",
        burst_size=args.num_requests,
        prompt_len=LengthDist("fixed", 128),
        output_len=LengthDist("fixed", 32),
    )
    warm_up = WorkloadConfig(num_requests=2, arrival="burst", burst_size=2, output_len=LengthDist("fixed", 4))
    with tempfile.TemporaryDirectory() as folder:
        secure, credentials = _secure_cluster(make_bundle(Path(folder)))
        plain = start_cluster(0, WORKER_ARGV, num_prefill=1, num_decode=1)
        systems = {"plaintext": (plain, PLAINTEXT_GATEWAY), "secured": (secure, credentials)}
        try:
            for children, creds in systems.values():
                _throughput(children, creds, warm_up)
            runs: dict[str, list[float]] = {name: [] for name in systems}
            for _ in range(args.rounds):
                for name, (children, creds) in systems.items():
                    runs[name].append(_throughput(children, creds, workload))
        finally:
            stop_cluster(plain)
            stop_cluster(secure)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    ratio = medians["secured"] / medians["plaintext"]
    print(f"\n{args.num_requests} requests x 128 prompt + 32 output tokens, 1P1D, {args.rounds} alternating rounds")
    for name, values in runs.items():
        print(f"{name:<10} out tok/s per round {' '.join(f'{v:.1f}' for v in values)}  median {medians[name]:.1f}")
    print(f"ratio secured / plaintext (medians): {ratio:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": vars(args), "runs": runs, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
