"""`splitserve up` when things go wrong: a port it needs is taken, a child is not ready in time, and
`up` itself is killed (its children must not outlive it)."""

from __future__ import annotations

import socket
from collections import deque
from pathlib import Path

import pytest

from splitserve.common.serving import free_port
from splitserve.services.launcher import cli, launcher
from splitserve.services.launcher.launcher import Child, ChildNotReady, wait_ready


@pytest.fixture
def taken_port():
    """A port something else listens on, as another program (or a stale `up`) would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield s.getsockname()[1]


def _up_argv(tmp_path: Path, port: int, http_port: int, admin_port: int) -> list[str]:
    ports = ["--port", str(port), "--http-port", str(http_port), "--admin-port", str(admin_port)]
    return ["up", *ports, "--secrets-dir", str(tmp_path)]


@pytest.mark.parametrize(
    ("taken", "flags"),
    [("http", ["--http-port", "--no-http"]), ("grpc", ["--port"]), ("admin", ["--admin-port"])],
)
def test_up_names_a_taken_port_and_its_flag_before_starting_anything(
    taken, flags, taken_port, tmp_path, monkeypatch, capsys
):
    def spawn(*args, **kwargs):
        raise AssertionError("`up` started a process before checking its ports")

    monkeypatch.setattr(launcher, "_spawn", spawn)
    ports = {"grpc": free_port(), "http": free_port(), "admin": free_port(), taken: taken_port}
    assert cli.main(_up_argv(tmp_path, ports["grpc"], ports["http"], ports["admin"])) == 2
    err = capsys.readouterr().err
    assert f"port {taken_port}" in err and all(flag in err for flag in flags), err


class _Running:
    """A process that has not exited (what wait_ready reads of a Popen)."""

    returncode = None

    def __init__(self, code: int | None = None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def test_a_child_not_ready_in_time_is_named_with_the_tail_of_its_log():
    log = deque([f"line {i}" for i in range(100)] + ["loading shard 3 of 4"])
    child = Child("decode-1", f"127.0.0.1:{free_port()}", "", _Running(), "decode", log)  # nothing listens there
    with pytest.raises(ChildNotReady) as e:
        wait_ready(child, timeout_s=0.5)
    message = str(e.value)
    assert "decode-1" in message and "--ready-timeout" in message and "loading shard 3 of 4" in message
    assert "line 0\n" not in message  # the tail only


def test_a_child_that_exits_while_starting_is_named_with_the_tail_of_its_log():
    log = deque(["Traceback (most recent call last):", "OSError: [Errno 98] Address already in use"])
    child = Child("gateway", f"127.0.0.1:{free_port()}", "", _Running(1), "gateway", log)
    with pytest.raises(ChildNotReady) as e:
        wait_ready(child, timeout_s=30, is_worker=False)
    message = str(e.value)
    assert "gateway" in message and "exited with code 1" in message and "Address already in use" in message


def test_up_waits_as_long_as_ready_timeout_says(tmp_path, monkeypatch):
    waited = []

    def start_cluster(*args, timeout_s, **kwargs):
        waited.append(timeout_s)
        raise ChildNotReady("stop here")

    monkeypatch.setattr(launcher, "start_cluster", start_cluster)
    argv = _up_argv(tmp_path, free_port(), free_port(), free_port())
    assert cli.main([*argv, "--ready-timeout", "400"]) == 2
    assert cli.main(argv) == 2
    assert waited == [400.0, launcher.READY_TIMEOUT_S]
