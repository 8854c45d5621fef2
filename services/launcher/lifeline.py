"""A lifeline between `splitserve up` (or any process that starts splitserve children) and its children:
a pipe whose write end only the parent holds. The parent never writes; each child keeps the read end
and blocks on it in a thread of its own. When the parent is gone, however it ended (SIGKILL included,
during its own shutdown or not), the kernel closes the write end, the read returns end-of-file and the
child kills itself: no gateway or worker is left holding its ports for the next `up`.

A pipe rather than the parent-death signal (prctl PR_SET_PDEATHSIG): that signal fires when the
*thread* that started the child exits, and `up` starts workers from its gRPC and planner threads too.
A child's own children (engine cores, tensor-parallel ranks) exit when their pipe to it closes.
"""

from __future__ import annotations

import functools
import os
import signal
import threading

LIFELINE_ENV = "SPLITSERVE_LIFELINE_FD"  # the read end's number in the child


class Lifeline:
    """The parent's side: one pipe for the process's lifetime, shared by every child it starts."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()  # neither is inherited unless passed (pass_fds)

    def child_env(self, env: dict[str, str]) -> dict[str, str]:
        return dict(env, **{LIFELINE_ENV: str(self.read_fd)})


@functools.cache
def parent_lifeline() -> Lifeline:
    """This process's lifeline, made on first use. (Two threads starting their first child at once
    might make two: harmless, this process holds both write ends.)"""
    return Lifeline()


def hold_lifeline() -> None:
    """In a child: die with the parent whose lifeline LIFELINE_ENV names (nothing without one). The
    variable is taken out of the environment, so this child's own children do not read a number that
    means nothing (or another file) in them."""
    fd = os.environ.pop(LIFELINE_ENV, None)
    if fd is not None:
        threading.Thread(target=_die_with_parent, args=(int(fd),), name="lifeline", daemon=True).start()


def _die_with_parent(fd: int) -> None:
    while os.read(fd, 1):  # the parent never writes: b"" is end-of-file, the parent is gone
        pass
    os.kill(os.getpid(), signal.SIGKILL)
