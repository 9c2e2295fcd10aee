"""What the benchmarks read about a process from /proc, and a free loopback port: one copy for every tool."""

from __future__ import annotations

import os


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, with the next one free too (a server there takes it for
    its framed port: ``fedlaunch.supervise.free_server_port``)."""
    from fedlaunch.supervise import free_server_port

    return free_server_port()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (/proc/PID/stat, fields 14 and 15); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def rss_anon_mib(pid: int) -> float | None:
    """Private resident memory of ``pid`` (RssAnon from /proc/PID/status) in MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None
