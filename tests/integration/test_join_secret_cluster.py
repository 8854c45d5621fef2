"""Issue 35 item 2 on real processes: a worker of a cluster started as `up` starts it is killed
(SIGKILL: it cannot deregister) and a squatter takes its address. The gateway keeps checking that
address until it forgets it; the squatter must receive nothing secret and get no traffic."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from cluster_helpers import engine_argv

from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.access import prepare_access
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

sys.path.insert(0, str(Path(__file__).parents[1]))
from squatter import Squatter  # noqa: E402


def test_dead_workers_address_taken_over_gets_no_secret_and_no_traffic(tmp_path, tiny_llama_dir):
    access = prepare_access(tmp_path / "secrets", secure=False, host="127.0.0.1")
    secret = access.cluster.join_secret
    assert secret
    children = start_cluster(
        0,
        engine_argv(tiny_llama_dir) + access.worker_argv,
        num_prefill=1,
        num_decode=1,
        gateway_argv=access.gateway_argv,
        cluster=access.cluster,
        http_port=None,
    )
    gateway, decode = children[0], children[2]
    squatter = None
    try:
        decode.proc.kill()
        decode.proc.wait()
        squatter = Squatter(int(decode.address.rpartition(":")[2]))
        registry = wpb_grpc.RegistryStub(access.cluster.blocking_channel(gateway.registry, to_worker=False))

        def decode_listed_healthy() -> bool | None:
            listed = {w.address: w for w in registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5).workers}
            return listed[decode.address].healthy if decode.address in listed else None

        deadline = time.monotonic() + 60  # bounds a broken run only: the gateway checks every second
        while decode_listed_healthy() and not squatter.called.is_set() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not squatter.received(secret), squatter.calls
        assert decode_listed_healthy() is not True  # unhealthy (or forgotten): nothing routed there
        assert squatter.calls == []  # not even a health check completed: the handshake failed first
    finally:
        if squatter is not None:
            squatter.stop()
        stop_cluster(children)
