"""Running an attacker as another local user (uid nobody, no groups, no capabilities), as issue 35's
probes did: possible only when the tests run as root and setpriv exists; otherwise a test that needs it
is skipped with that reason."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
NEEDS = "needs root and setpriv to run the attacker as user nobody"


def nobody_prefix() -> list[str] | None:
    """The command prefix that drops to nobody, or None where this machine cannot."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    user = pwd.getpwnam("nobody")
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]


def spawn_as_nobody(script: str, *args: str) -> subprocess.Popen:
    """tests/<script> *args as user nobody (skips the test where that is impossible), lines on stdout."""
    prefix = nobody_prefix()
    if prefix is None:
        pytest.skip(NEEDS)
    env = dict(os.environ, PYTHONPATH=str(TESTS), HOME="/tmp")
    command = [*prefix, sys.executable, str(TESTS / script), *args]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
