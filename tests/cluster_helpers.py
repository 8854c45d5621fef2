"""Helpers for tests that talk to real gateway/worker processes over gRPC."""

from __future__ import annotations

import time
import urllib.request

import grpc

from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc

KV_BYTES = 4 * 1024**2


def engine_argv(folder) -> list[str]:
    return ["--model", str(folder), "--kv-cache-bytes", str(KV_BYTES), "--block-size", "8", "--max-model-len", "256"]


def stub(address: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(address))


def greedy_request(ids: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParameters(**{"temperature": 0.0, **sampling}),
                              stopping=pb.StoppingCriteria(max_tokens=max_tokens))


def collect(stub_, request, timeout=60.0) -> list[pb.GenerateResponse]:
    return list(stub_.Generate(request, timeout=timeout))


def tokens(stub_, request, timeout=60.0) -> list[int]:
    return [t for chunk in collect(stub_, request, timeout) for t in chunk.token_ids]


def load(worker_address: str) -> wpb.LoadReport:
    return wpb_grpc.WorkerStub(grpc.insecure_channel(worker_address)).GetLoad(wpb.GetLoadRequest(), timeout=5)


def all_blocks_free(worker_address: str) -> bool:
    r = load(worker_address)
    return (r.num_free_blocks == r.num_total_blocks and r.num_running == 0 and r.num_waiting == 0
            and r.num_awaiting_kv == 0)


def wait_all_free(addresses: list[str], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(all_blocks_free(a) for a in addresses):
            return True
        time.sleep(0.1)
    return all(all_blocks_free(a) for a in addresses)


def metric(metrics_address: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series' samples whose labels include the given ones."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[-1])
    return total
