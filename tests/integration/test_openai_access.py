"""The HTTP API of a gateway with public TLS, client certificates and API keys, and no worker:
HTTPS with the gateway's certificate, 401 without a key, 429 + Retry-After when a key is over its
limit (one limiter for gRPC and HTTP), 503 while no worker can serve. Certificates made here.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
from cluster_helpers import secrets_bundle

from splitserve.common.security import GatewayCredentials
from splitserve.common.serving import free_port
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

KEYS = "sk-main name=main\nsk-slow name=slow rps=0.01 burst=1\n"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    return secrets_bundle(tmp_path_factory.mktemp("secrets"), KEYS)


@pytest.fixture(scope="module")
def gateway(bundle, tiny_llama_dir):
    """(gRPC address, HTTPS base URL, metrics address) of a gateway without workers."""
    ports = [free_port() for _ in range(3)]
    argv = ["gateway", "--model", str(tiny_llama_dir), "--port", str(ports[0]), "--metrics-port", str(ports[1])]
    argv += ["--http-port", str(ports[2]), "--tls-cert", str(bundle.gateway_cert), "--tls-key", str(bundle.gateway_key)]
    argv += ["--tls-client-ca", str(bundle.ca_cert), "--api-key-file", str(bundle.api_keys.parent / "test-keys")]
    proc = subprocess.Popen([sys.executable, "-m", "splitserve.services.launcher.cli", *argv])
    base = f"https://localhost:{ports[2]}"
    try:
        _wait_up(base, bundle, proc)
        yield f"localhost:{ports[0]}", base, f"127.0.0.1:{ports[1]}"
    finally:
        proc.terminate()
        proc.wait(15)


def _tls(bundle, client_cert: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(bundle.ca_cert))
    if client_cert:
        context.load_cert_chain(bundle.client_cert, bundle.client_key)
    return context


def _wait_up(base: str, bundle, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the gateway exited with code {proc.returncode}"
        try:
            if httpx.get(f"{base}/health", verify=_tls(bundle), timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError("the gateway's HTTP API did not come up within 60 s")


def _client(base: str, bundle, key: str) -> openai.OpenAI:
    http = httpx.Client(verify=_tls(bundle))
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, http_client=http)


def test_https_needs_a_client_certificate(gateway, bundle):
    _, base, _ = gateway
    assert httpx.get(f"{base}/health", verify=_tls(bundle)).status_code == 200
    with pytest.raises(httpx.TransportError):  # the handshake, or the first read after it, fails
        httpx.get(f"{base}/health", verify=_tls(bundle, client_cert=False))
    with pytest.raises(httpx.TransportError):
        httpx.get(base.replace("https", "http") + "/health")


def test_keys_guard_the_api_but_not_health(gateway, bundle):
    _, base, _ = gateway
    with pytest.raises(openai.AuthenticationError) as err:
        _client(base, bundle, "sk-wrong").models.list()
    assert err.value.body["type"] == "authentication_error" and "Bearer" in err.value.body["message"]
    assert _client(base, bundle, "sk-main").models.list().data[0].owned_by == "splitserve"
    assert httpx.get(f"{base}/ready", verify=_tls(bundle)).status_code == 503  # open, and no worker


def test_no_worker_is_503(gateway, bundle):
    _, base, _ = gateway
    with pytest.raises(openai.InternalServerError) as err:
        _client(base, bundle, "sk-main").completions.create(model=None, prompt="hi", max_tokens=2)
    assert err.value.status_code == 503 and "no healthy worker" in err.value.message


def test_a_key_limit_counts_grpc_and_http_calls(gateway, bundle):
    """sk-slow has one call (burst 1, then 0.01/s): spent on gRPC, the HTTP call is refused."""
    address, base, _ = gateway
    identity = bundle.client_identity()
    channel = GatewayCredentials(str(bundle.ca_cert), "sk-slow", identity).blocking_channel(address)
    with channel:
        pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        with pytest.raises(grpc.RpcError) as rpc_err:
            pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        assert rpc_err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(openai.RateLimitError) as err:
        _client(base, bundle, "sk-slow").models.list()
    assert int(err.value.response.headers["retry-after"]) >= 1 and "sk-slow" not in err.value.message
    assert err.value.body["code"] == "rate_limit_exceeded"


def test_refusals_are_counted_in_the_metrics_port_registry(gateway, bundle):
    _, base, metrics = gateway
    assert httpx.get(f"{base}/v1/models", verify=_tls(bundle)).status_code == 401
    text = httpx.get(f"{base}/metrics", verify=_tls(bundle)).text
    assert _sample(text, 'splitserve_gateway_http_requests_total{route="/v1/models",status="401"}') >= 1
    assert _sample(text, 'splitserve_gateway_denied_calls_total{code="UNAUTHENTICATED",plane="public"}') >= 1
    assert _names(text) == _names(httpx.get(f"http://{metrics}/metrics").text)


def _sample(text: str, series: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " "))


def _names(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
