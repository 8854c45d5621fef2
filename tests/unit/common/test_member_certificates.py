"""Issue 35 item 8's residue: internal servers (a worker's Worker service, the gateway's Registry on
its internal port, the launcher) take calls only from members of the cluster. The cluster CA signs a
public client's certificate too (client.pem of a `splitserve certs` bundle, handed to API clients),
so a verified certificate is not enough: it must name the cluster (CLUSTER_TLS_NAME). Each test is
the attack: the bundle's client certificate plus the join secret (a client that also learned the
secret) calls the service and is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from splitserve.common.security import AccessGuard, ClusterSecurity, TlsIdentity
from splitserve.common.serving import free_port
from splitserve.gateway.server import GatewaySecurity
from splitserve.protos.v1 import launcher_pb2 as lpb
from splitserve.protos.v1 import launcher_pb2_grpc as lpb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.certs import SecureBundle, make_bundle
from splitserve.services.launcher.supervisor import Supervisor, serve_launcher

WORKER_SERVICE = wpb.DESCRIPTOR.services_by_name["Worker"].full_name


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> SecureBundle:
    return make_bundle(tmp_path_factory.mktemp("bundle"), ("localhost", "127.0.0.1"))


def client_with_secret(bundle: SecureBundle) -> ClusterSecurity:
    """A public client that holds the bundle's client certificate and learned the join secret."""
    client = TlsIdentity.load(str(bundle.client_cert), str(bundle.client_key))
    return ClusterSecurity(bundle.cluster().join_secret, bundle.ca_cert.read_bytes(), client)


class _Worker(wpb_grpc.WorkerServicer):
    async def GetLoad(self, request, context):
        return wpb.LoadReport(num_total_blocks=8, num_free_blocks=8, block_size=8)

    async def Generate(self, request, context):
        yield wpb.WorkerGenerateResponse(token_ids=[1])


class _Registry(wpb_grpc.RegistryServicer):
    async def ListWorkers(self, request, context):
        return wpb.ListWorkersResponse()


async def _serve(bundle: SecureBundle, add, guard: AccessGuard) -> tuple[grpc.aio.Server, str]:
    cluster = bundle.cluster()
    server = grpc.aio.server(interceptors=[guard])
    add(server)
    credentials = cluster.server_credentials()
    assert credentials is not None
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _codes(caller: ClusterSecurity, address: str) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    channel = caller.worker_channel(address)
    stub = wpb_grpc.WorkerStub(channel)
    codes = []
    for call in (
        lambda: stub.GetLoad(wpb.GetLoadRequest(), timeout=5),
        lambda: _drain(stub.Generate(wpb.WorkerGenerateRequest(request_id="r"), timeout=5)),
    ):
        try:
            await call()
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
    await channel.close()
    return codes[0], codes[1]


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_worker_service_refuses_the_public_client_certificate_even_with_the_secret(bundle):
    async def main():
        add = lambda s: wpb_grpc.add_WorkerServicer_to_server(_Worker(), s)  # noqa: E731
        guard = AccessGuard(bundle.cluster(), (WORKER_SERVICE,), members_only=True)  # as serve_worker makes it
        server, address = await _serve(bundle, add, guard)
        try:
            return await _codes(client_with_secret(bundle), address), await _codes(bundle.cluster(), address)
        finally:
            await server.stop(grace=None)

    outsider, member = asyncio.run(main())
    assert outsider == (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED)
    assert member == (grpc.StatusCode.OK, grpc.StatusCode.OK)


def test_registry_on_the_internal_port_refuses_the_public_client_certificate(bundle):
    async def call(caller: ClusterSecurity, address: str) -> grpc.StatusCode:
        channel = caller.gateway_channel(address)
        try:
            await wpb_grpc.RegistryStub(channel).ListWorkers(wpb.ListWorkersRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()
        finally:
            await channel.close()

    async def main():
        add = lambda s: wpb_grpc.add_RegistryServicer_to_server(_Registry(), s)  # noqa: E731
        guard = GatewaySecurity(cluster=bundle.cluster()).internal_guard()
        server, address = await _serve(bundle, add, guard)
        try:
            return await call(client_with_secret(bundle), address), await call(bundle.cluster(), address)
        finally:
            await server.stop(grace=None)

    assert asyncio.run(main()) == (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK)


def test_launcher_refuses_the_public_client_certificate_even_with_the_secret(bundle, tmp_path: Path):
    supervisor = Supervisor([], [], "127.0.0.1", drain_timeout_s=1.0)
    server = serve_launcher(supervisor, "127.0.0.1", free_port("127.0.0.1"), bundle.cluster())
    try:
        channel = client_with_secret(bundle).blocking_channel(supervisor.admin_address, to_worker=False)
        with channel, pytest.raises(grpc.RpcError) as raised:
            lpb_grpc.LauncherStub(channel).Scale(lpb.ScaleRequest(), timeout=5)
    finally:
        server.stop(grace=None)
    assert raised.value.code() == grpc.StatusCode.PERMISSION_DENIED
