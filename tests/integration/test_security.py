"""Security on real processes (docs/security.md): a 1P1D cluster with everything on (public TLS with
client certificates, API keys with limits, cluster mTLS, the join secret), certificates made here,
next to the same cluster in plaintext.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import engine_argv, greedy_request, secrets_bundle
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.security import JOIN_SECRET_HEADER, ClusterSecurity, GatewayCredentials
from splitserve.gateway.auth import RETRY_AFTER_KEY
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [2, 4, 6, 8], list(range(3, 40))]
KEYS = "sk-main name=main\nsk-limited name=limited rps=1 burst=2\nsk-single name=single concurrency=1\n"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return secrets_bundle(tmp_path_factory.mktemp("secrets"), KEYS)


@pytest.fixture(scope="module")
def secure(bundle, tiny_llama_dir):
    gateway_argv = bundle.gateway_argv() + [
        "--api-key-file",
        str(bundle.api_keys.parent / "test-keys"),
        "--tls-client-ca",
        str(bundle.ca_cert),
    ]
    children = start_cluster(
        0,
        engine_argv(tiny_llama_dir) + bundle.worker_argv(),
        num_prefill=1,
        num_decode=1,
        gateway_argv=gateway_argv,
        cluster=bundle.cluster(),
    )
    try:
        yield children
    finally:
        stop_cluster(children)


def _stub(bundle, address: str, key: str | None = "sk-main", client_cert: bool = True) -> pb_grpc.GenerationStub:
    identity = bundle.client_identity() if client_cert else None
    return pb_grpc.GenerationStub(GatewayCredentials(str(bundle.ca_cert), key, identity).blocking_channel(address))


def _tokens(stub: pb_grpc.GenerationStub, request: pb.GenerateRequest) -> list[int]:
    return [t for chunk in stub.Generate(request, timeout=60) for t in chunk.token_ids]


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code()


def test_outputs_with_everything_on_equal_plaintext(secure, bundle, tiny_llama_dir):
    requests = [greedy_request(p, 12) for p in PROMPTS]
    stub = _stub(bundle, secure[0].address)
    with ThreadPoolExecutor(len(requests)) as pool:
        got = list(pool.map(lambda r: _tokens(stub, r), requests))
    plain = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1)
    try:
        plain_stub = pb_grpc.GenerationStub(grpc.insecure_channel(plain[0].address))
        want = [_tokens(plain_stub, r) for r in requests]
    finally:
        stop_cluster(plain)
    assert got == want and all(len(t) == 12 for t in got)


def test_missing_or_wrong_key_is_unauthenticated_and_health_stays_open(secure, bundle):
    address, request = secure[0].address, greedy_request(PROMPTS[0], 4)
    for key in (None, "sk-wrong"):
        with pytest.raises(grpc.RpcError) as raised:
            _tokens(_stub(bundle, address, key), request)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in raised.value.details()
    assert _code(lambda: _stub(bundle, address, None).ListModels(pb.ListModelsRequest(), timeout=5)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    identity = bundle.client_identity()
    channel = GatewayCredentials(str(bundle.ca_cert), None, identity).blocking_channel(address)
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_and_certificate_less_clients_cannot_connect(secure, bundle):
    address = secure[0].address
    plain = pb_grpc.GenerationStub(grpc.insecure_channel(address))
    assert _code(lambda: plain.ListModels(pb.ListModelsRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    no_cert = _stub(bundle, address, "sk-main", client_cert=False)  # TLS, right key, no client certificate
    assert _code(lambda: no_cert.ListModels(pb.ListModelsRequest(), timeout=5)) == grpc.StatusCode.UNAVAILABLE
    assert _stub(bundle, address).ListModels(pb.ListModelsRequest(), timeout=5).models


def test_rate_limit_trips_with_retry_after_and_recovers(secure, bundle):
    stub = _stub(bundle, secure[0].address, "sk-limited")  # rps=1 burst=2
    list_models = stub.ListModels.with_call
    for _ in range(2):
        list_models(pb.ListModelsRequest(), timeout=5)
    with pytest.raises(grpc.RpcError) as raised:
        list_models(pb.ListModelsRequest(), timeout=5)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after = dict(raised.value.trailing_metadata())[RETRY_AFTER_KEY]
    assert retry_after == "1" and "sk-limited" not in raised.value.details()
    time.sleep(float(retry_after))
    list_models(pb.ListModelsRequest(), timeout=5)  # recovered
    _tokens(_stub(bundle, secure[0].address, "sk-main"), greedy_request(PROMPTS[1], 2))  # other keys unaffected


def test_concurrency_limit_per_key(secure, bundle):
    stub = _stub(bundle, secure[0].address, "sk-single")  # concurrency=1
    stream = stub.Generate(greedy_request(PROMPTS[2], 48), timeout=60)
    first = next(stream)  # the stream is running
    assert _code(lambda: stub.ListModels(pb.ListModelsRequest(), timeout=5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(first.token_ids) + sum(len(c.token_ids) for c in stream) == 48
    stub.ListModels(pb.ListModelsRequest(), timeout=5)  # its slot came back


def test_outsiders_cannot_register_publish_or_call_workers(secure, bundle):
    gateway, decode = secure[0], secure[2]
    on_public_port = wpb_grpc.RegistryStub(bundle.cluster().blocking_channel(gateway.address, to_worker=False))
    listing = wpb.ListWorkersRequest()  # the Registry is on the internal port only, even for members
    assert _code(lambda: on_public_port.ListWorkers(listing, timeout=5)) == grpc.StatusCode.UNIMPLEMENTED
    no_secret = bundle.cluster(join_secret=False)
    registry = wpb_grpc.RegistryStub(no_secret.blocking_channel(gateway.registry, to_worker=False))
    register = wpb.RegisterWorkerRequest(address="127.0.0.1:1", model="rogue")
    assert _code(lambda: registry.RegisterWorker(register, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    publish = wpb.PublishKVEventsRequest(address="127.0.0.1:1", instance_id="x", seq=1, block_size=8)
    assert _code(lambda: registry.PublishKVEvents(publish, timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    request = wpb.WorkerGenerateRequest(request_id="rogue", prompt_token_ids=PROMPTS[0])
    worker = wpb_grpc.WorkerStub(no_secret.blocking_channel(decode.address))  # a cluster certificate, no secret
    assert _code(lambda: list(worker.Generate(request, timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
    with_secret_no_cert = ClusterSecurity.from_files(str(bundle.ca_cert), secret_file=str(bundle.join_secret))
    worker = wpb_grpc.WorkerStub(with_secret_no_cert.blocking_channel(decode.address))  # no certificate: no TLS
    assert _code(lambda: list(worker.Generate(request, timeout=5))) == grpc.StatusCode.UNAVAILABLE
    members = bundle.cluster()
    listed = wpb_grpc.RegistryStub(members.blocking_channel(gateway.registry, to_worker=False)).ListWorkers(
        wpb.ListWorkersRequest(), timeout=5
    )
    assert sorted(w.address for w in listed.workers) == sorted(c.address for c in secure[1:])  # no rogue


def test_worker_without_the_secret_is_refused_and_exits(secure, bundle, tiny_llama_dir):
    argv = [
        sys.executable,
        "-m",
        "splitserve.services.launcher.cli",
        "worker",
        "--gateway",
        secure[0].registry,
        "--cluster-ca",
        str(bundle.ca_cert),
        "--cluster-cert",
        str(bundle.cluster_cert),
        "--cluster-key",
        str(bundle.cluster_key),
        *engine_argv(tiny_llama_dir),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "refused this worker" in done.stderr and JOIN_SECRET_HEADER in done.stderr
