"""One writer per run directory: an OS-level exclusive lock held for the server's lifetime.

``RUN_DIR/server.lock`` is locked with ``flock(LOCK_EX | LOCK_NB)``; the kernel releases the lock when the process
exits however it exits (``kill -9`` included), so there is no stale-lock step after a crash: the file may stay,
the lock does not. While it holds the lock the server writes its pid, host, address and start time into the file,
so a second server on the same run directory exits at once naming the holder (etcd and NVFlare refuse a second
writer the same way). Two servers would otherwise interleave ``rounds.jsonl`` and mix snapshot timelines.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; the lock degrades to the holder record only
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "server.lock"


class RunDirLocked(Exception):
    """Another live process holds the run directory; the message names it."""


class RunDirLock:
    def __init__(self, run_dir: Path, f: IO[str]) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_NAME
        self._file: IO[str] | None = f

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike[str], address: str = "") -> RunDirLock:
        """Lock ``run_dir`` (created if missing) or raise :class:`RunDirLocked` naming the holder."""
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            f = open(run_dir / LOCK_NAME, "a+")  # noqa: SIM115 - held open for the server's lifetime
        except OSError as e:
            raise RunDirLocked(f"{run_dir / LOCK_NAME}: cannot open the run directory's lock file "
                               f"({e.strerror or e})") from None
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _describe(_read_holder(f))
                f.close()
                raise RunDirLocked(f"{run_dir} is in use by another fedserver ({holder}); two servers on one run "
                                   "directory would interleave rounds.jsonl and mix snapshot timelines. Stop "
                                   "that server first, or give this one another --run-dir") from None
        lock = cls(run_dir, f)
        lock.update(address)
        return lock

    @classmethod
    def probe(cls, run_dir: str | os.PathLike[str]) -> None:
        """Raise :class:`RunDirLocked` at once when another process holds ``run_dir`` (the CLI asks before it
        imports torch, so a second server says so in well under a second); creates nothing."""
        if (Path(run_dir) / LOCK_NAME).is_file():
            cls.acquire(run_dir).release()

    def update(self, address: str) -> None:
        """Record the holder (pid, host, address, start time) in the lock file, which this process owns."""
        if self._file is None:
            return
        record = {"pid": os.getpid(), "host": socket.gethostname(), "address": address,
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.seek(0)
                self._file.truncate()
            self._file.close()  # closing the descriptor releases the flock
            self._file = None

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(f: IO[str]) -> dict[str, Any]:
    try:
        f.seek(0)
        value = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "its pid is not recorded yet"
    parts = [f"pid {holder.get('pid', '?')}"]
    if holder.get("host"):
        parts.append(f"on {holder['host']}")
    if holder.get("address"):
        parts.append(f"listening on {holder['address']}")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    return ", ".join(parts)
