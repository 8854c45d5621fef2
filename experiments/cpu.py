"""CPU time of other processes, for benchmarks that split work across processes."""

from __future__ import annotations

import os


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used so far (Linux /proc; its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
