"""`splitserve up` when things go wrong: a port it needs is taken, a child is not ready in time, and
`up` itself is killed (its children must not outlive it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

import pytest
from cluster_helpers import engine_argv

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


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_child_not_ready_in_time_is_named_with_the_tail_of_its_log():
    log = deque([f"line {i}" for i in range(100)] + ["loading shard 3 of 4"])
    child = Child("decode-1", f"127.0.0.1:{free_port()}", "", _Running(), "decode", log)  # nothing listens there
    with pytest.raises(ChildNotReady) as e:
        wait_ready(child, timeout_s=0.5)
    message = str(e.value)
    assert "decode-1" in message and "--ready-timeout" in message and "loading shard 3 of 4" in message
    assert "line 0\n" not in message  # the tail only


@pytest.mark.unit
def test_a_child_that_exits_while_starting_is_named_with_the_tail_of_its_log():
    log = deque(["Traceback (most recent call last):", "OSError: [Errno 98] Address already in use"])
    child = Child("gateway", f"127.0.0.1:{free_port()}", "", _Running(1), "gateway", log)
    with pytest.raises(ChildNotReady) as e:
        wait_ready(child, timeout_s=30, is_worker=False)
    message = str(e.value)
    assert "gateway" in message and "exited with code 1" in message and "Address already in use" in message


@pytest.mark.unit
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


def _descendants(pid: int) -> list[int]:
    """Every process below pid (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _running(pid: int) -> bool:
    """False once pid is gone or a zombie (an orphan's zombie waits for whoever reaps orphans here)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.integration
def test_children_of_up_exit_when_up_is_killed(tiny_llama_dir, tmp_path):
    """SIGKILL `up` (no handler runs): its gateway, its worker and the worker's engine core all exit."""
    argv = _up_argv(tmp_path, free_port(), 0, free_port())
    up = subprocess.Popen(
        [sys.executable, "-m", "splitserve.services.launcher.cli", *argv, *engine_argv(tiny_llama_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready, lines = threading.Event(), []

    def read() -> None:
        for line in up.stdout:  # read to the end: a full pipe would stop `up`
            lines.append(line)
            if line.startswith("splitserve is up"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    children = []
    try:
        assert ready.wait(180), "".join(lines[-30:])
        children = _descendants(up.pid)
        assert len(children) >= 3, children  # gateway, worker, its engine core
        up.kill()
        up.wait(10)
        deadline = threading.Event()
        for _ in range(300):  # 60 s: only a broken run waits this long
            if not any(_running(pid) for pid in children):
                break
            deadline.wait(0.2)
        assert not [pid for pid in children if _running(pid)], "children of a killed `up` still run"
    finally:
        up.kill()
        for pid in children:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
