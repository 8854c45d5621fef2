"""Issue 35 items 1, 2, 7, 8: the join secret is never presented to a server that has not proven it
belongs to the cluster. Each test is the attack: a squatter on a port a member of the cluster dials
(tests/squatter.py) records what it is sent; the cluster must send it nothing secret and refuse it."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from splitserve.common.serving import free_port
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import launcher_pb2 as lpb
from splitserve.protos.v1 import launcher_pb2_grpc as lpb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.launcher.access import InsecureSecrets, UpAccess, prepare_access
from splitserve.services.launcher.launcher import wait_healthy
from splitserve.services.launcher.supervisor import Supervisor, serve_launcher

sys.path.insert(0, str(Path(__file__).parents[1]))
from squatter import Squatter  # noqa: E402

SQUATTER = Path(__file__).parents[1] / "squatter.py"


@pytest.fixture
def access(tmp_path: Path) -> UpAccess:
    return prepare_access(tmp_path / "secrets", secure=False, host="127.0.0.1")


@pytest.fixture
def secret(access: UpAccess) -> str:
    assert access.cluster.join_secret
    return access.cluster.join_secret


@pytest.fixture
def squatter():
    s = Squatter(free_port("127.0.0.1"))
    yield s
    s.stop()


def test_up_readiness_check_gives_a_squatter_nothing_and_refuses_it(access, secret, squatter):
    with pytest.raises(TimeoutError):
        wait_healthy(squatter.address, 3.0, cluster=access.cluster)  # `up` waiting for a worker there
    assert not squatter.received(secret), squatter.calls


def test_up_readiness_check_of_the_gateway_gives_a_squatter_nothing(access, secret, squatter):
    with pytest.raises(TimeoutError):
        wait_healthy(squatter.address, 3.0, cluster=access.cluster, is_worker=False)
    assert not squatter.received(secret), squatter.calls


def test_gateway_health_checks_give_a_squatter_nothing_and_stop_routing_to_it(access, secret, squatter):
    async def check_twice() -> bool:
        workers = WorkerSet(channel_factory=access.cluster.worker_channel, check_timeout_s=2.0)
        handle = workers.add(wpb.RegisterWorkerRequest(address=squatter.address, model="m"))
        for _ in range(WorkerSet.FAILURES_BEFORE_UNHEALTHY):
            await workers.check_all(_nothing)
        healthy = handle.healthy
        await workers.close()
        return healthy

    assert asyncio.run(check_twice()) is False  # the address has not proven who it is: no traffic
    assert not squatter.received(secret), squatter.calls


async def _nothing(address: str) -> None:
    return None


def _nobody() -> tuple[int, int] | None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    user = pwd.getpwnam("nobody")
    return user.pw_uid, user.pw_gid


def test_squatter_as_another_user_gets_nothing(access, secret):
    ids = _nobody()
    if ids is None:
        pytest.skip("needs root and setpriv to run the squatter as user nobody")
    port = free_port("127.0.0.1")
    command = ["setpriv", f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", sys.executable, str(SQUATTER)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), HOME="/tmp")
    proc = subprocess.Popen([*command, str(port)], stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        with pytest.raises(TimeoutError):
            wait_healthy(f"127.0.0.1:{port}", 3.0, cluster=access.cluster)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert secret not in out, out


# --- item 7: the secrets folder is refused unless private -------------------------------------------


def test_secrets_folder_writable_by_others_is_refused(tmp_path: Path):
    folder = tmp_path / "secrets"
    prepare_access(folder, secure=False, host="127.0.0.1")
    folder.chmod(0o777)
    with pytest.raises(InsecureSecrets, match="writable by others"):
        prepare_access(folder, secure=False, host="127.0.0.1")


def test_secret_file_readable_by_others_is_refused(tmp_path: Path):
    folder = tmp_path / "secrets"
    prepare_access(folder, secure=False, host="127.0.0.1")
    (folder / "join-secret").chmod(0o666)
    with pytest.raises(InsecureSecrets, match="join-secret"):
        prepare_access(folder, secure=False, host="127.0.0.1")


def test_secrets_owned_by_another_user_are_refused(tmp_path: Path):
    ids = _nobody()
    if ids is None:
        pytest.skip("needs root to give the folder to user nobody")
    folder = tmp_path / "secrets"
    prepare_access(folder, secure=False, host="127.0.0.1")
    os.chown(folder / "join-secret", *ids)
    with pytest.raises(InsecureSecrets, match="owned by"):
        prepare_access(folder, secure=False, host="127.0.0.1")


# --- item 8: internal servers take only the cluster's certificates ---------------------------------


def test_launcher_refuses_a_client_without_a_cluster_certificate(access, tmp_path: Path):
    supervisor = Supervisor([], [], "127.0.0.1", drain_timeout_s=1.0)
    server = serve_launcher(supervisor, "127.0.0.1", free_port("127.0.0.1"), access.cluster)
    try:
        ca = access.cluster.ca_pem
        assert ca is not None
        credentials = grpc.ssl_channel_credentials(ca)  # verifies the launcher, but shows no certificate
        options = [("grpc.ssl_target_name_override", "splitserve-cluster")]
        with grpc.secure_channel(supervisor.admin_address, credentials, options=options) as channel:
            stub = lpb_grpc.LauncherStub(channel)
            metadata = access.cluster.call_metadata  # even holding the secret
            with pytest.raises(grpc.RpcError) as raised:
                stub.Scale(lpb.ScaleRequest(), timeout=5, metadata=metadata)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)
