"""`splitserve up` when things go wrong: a port it needs is taken, a child is not ready in time, and
`up` itself is killed (its children must not outlive it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from cluster_helpers import engine_argv

from splitserve.common.serving import free_port


def _up_argv(tmp_path: Path, port: int, http_port: int, admin_port: int) -> list[str]:
    ports = ["--port", str(port), "--http-port", str(http_port), "--admin-port", str(admin_port)]
    return ["up", *ports, "--secrets-dir", str(tmp_path)]


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
