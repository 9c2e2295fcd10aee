"""What the launcher reads from its children's logs (JSON lines and CLI errors): a process's last error, the
clients that vanished on purpose, the server's waiting and stopped events, the DP budget's end."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def ended_by_dp_budget(log: Path, max_bytes: int = 64 << 10) -> bool:
    """The server's last ``federation.finished`` event says its DP budget was spent (outcome ``dp_budget``)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return False
    finished = [line for line in lines if '"federation.finished"' in line]
    return bool(finished) and '"dp_budget"' in finished[-1]


def last_error(log: Path, max_bytes: int = 256 << 10) -> str:
    """A process's last error from its log: the exception line of its last traceback, its last line from a CLI
    (``fedserver: ...``, ``fedclient: ...``), and its last error-level JSON log event; "" when there is none."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    exception = cli = event = ""
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if in_traceback and line and not line.startswith((" ", "\t")):
            exception, in_traceback = line.strip(), line.startswith("During handling")
            continue
        if line.startswith(("fedserver: ", "fedclient: ", "launch: ")) and "note:" not in line:
            cli = line.strip()
        elif line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                fields = " ".join(f"{k}={v}" for k, v in record.items()
                                  if k not in ("event", "level", "timestamp", "component"))
                event = f"{record.get('event')} {fields}".strip()
    parts = [p for p in (cli, exception if exception not in cli else "", f"log event: {event}" if event else "")
             if p]
    return "\n".join(parts)


def vanished_count(log: Path | None) -> int:
    """Clients of a host that left on purpose (simulated dropout or availability), from the host's log."""
    if log is None:
        return 0
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    import re

    hosted = [int(m) for m in re.findall(r"^host \d+-\d+: \d+/\d+ finished, (\d+) vanished", text, re.M)]
    return hosted[-1] if hosted else text.count("vanished (simulated device)")


def clients_waiting(run_dir: Path) -> tuple[int, int] | None:
    """The server's last ``round.waiting`` event (ready, needed) from its JSON log, if any."""
    try:
        with open(run_dir / "server.log", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (64 << 10)))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"round.waiting"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                return int(record["ready"]), int(record["needed"])
    return None


def file_size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def logged_since(path: Path | None, offset: int, needle: str) -> bool:
    """Whether ``needle`` was written to ``path`` after byte ``offset``."""
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return needle.encode() in f.read()
    except OSError:
        return False
