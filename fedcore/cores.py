"""How many torch threads a client process gets when several share this machine's cores.

Every torch process starts as many intra-op threads as the machine has cores; three client processes on two cores
then run six busy threads that preempt one another (the 3-client quickstart took 46 s instead of 8 s). A client
process that shares the machine gets ``max(1, cores // processes)`` threads instead: the launcher knows how many
client processes it starts; a standalone ``fedclient`` counts the client processes running on this machine when
it starts. ``--torch-threads N`` overrides either.
"""

from __future__ import annotations

import os
from pathlib import Path


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover (not Linux)
        return max(1, os.cpu_count() or 1)


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """``max(1, cores // processes)``: the torch threads of each of ``processes`` co-hosted client processes."""
    return max(1, (cores if cores is not None else cpu_cores()) // max(1, processes))


def is_client_command(argv: list[str]) -> bool:
    """Whether a command line runs a fedguard client process (``fedclient``, ``python -m fedclient`` or a
    launcher's client host ``fedlaunch worker``)."""
    names = [Path(a).name for a in argv[:3]]
    if "fedclient" in names:
        return True
    return any(argv[i:i + 2] == ["-m", "fedclient"] for i in range(min(len(argv), 3))) or (
        "worker" in argv[:4] and any(a.endswith(("fedlaunch", "fedguard-launch")) for a in argv[:3]))


def client_processes(proc: Path = Path("/proc")) -> int:
    """Client processes running on this machine (this one included; at least 1). Reads ``/proc``; 1 elsewhere."""
    count = 0
    try:
        entries = list(proc.iterdir())
    except OSError:
        return 1
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # the process ended, or is not ours to read
            continue
        count += is_client_command([a for a in argv if a])
    return max(1, count)
