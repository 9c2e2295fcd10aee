"""``fedserver`` that kills itself with SIGKILL (as a power cut would) at one point of one round's save: the fault
injection of the crash/resume tests, kept out of the production modules.

    python -m tests.crash_server POINT:ROUND <fedserver arguments>

The server is the real one (``fedserver.cli``'s parser and configuration, :func:`fedserver.app.serve`); only its
state store is :class:`CrashingStore`, handed in through the store seam (``serve(opener=...)``). POINT is where in
the save of round ROUND's snapshot it dies:

- ``saving``: the round was aggregated, reported and completed in memory, nothing of it is on disk yet;
- ``files_written``: the round's model files are in place, the transaction that commits them has not run;
- ``committed``: the snapshot is committed, the round's ``rounds.jsonl`` row is not written yet.

Exits 1 when the point was never reached (the test then fails on the exit status).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedcore.config import PersistenceConfig
from fedserver.store import SaveStats, Snapshot, StateStore

POINTS = ("saving", "files_written", "committed")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class CrashingStore(StateStore):
    """A state store that dies at ``point`` of the save of round ``round_`` (see the module docstring)."""

    def __init__(self, directory: Path, p: PersistenceConfig, point: str, round_: int) -> None:
        if point not in POINTS:
            raise ValueError(f"crash point must be one of {POINTS}, got {point!r}")
        self.point, self.round = point, round_
        self._saving = -1
        super().__init__(directory, keep=p.keep_snapshots, fsync=p.fsync, after_files_written=self._files_written)

    def _files_written(self, _paths: list[Path]) -> None:
        if self.point == "files_written" and self._saving == self.round:
            die()

    def save(self, snap: Snapshot, history_tail: Sequence[dict[str, Any]] = ()) -> SaveStats:
        self._saving = snap.completed_rounds
        if self.point == "saving" and snap.completed_rounds == self.round:
            die()
        stats = super().save(snap, history_tail)
        if self.point == "committed" and snap.completed_rounds == self.round:
            die()
        return stats


def parse_point(text: str) -> tuple[str, int]:
    point, _, round_ = text.partition(":")
    if point not in POINTS or not round_.isdigit():
        raise SystemExit(f"crash_server: expected POINT:ROUND with POINT one of {POINTS}, got {text!r}")
    return point, int(round_)


def main(argv: list[str]) -> int:
    from fedcore.log import configure_logging
    from fedserver.app import serve
    from fedserver.cli import build_parser, config_from_args

    point, round_ = parse_point(argv[0])
    args = build_parser().parse_args(argv[1:])
    config = config_from_args(args)
    configure_logging(json=config.server.log_json, level=config.server.log_level)

    def opener(directory: Path, p: PersistenceConfig) -> StateStore:
        return CrashingStore(directory, p, point, round_)

    asyncio.run(serve(config, linger_s=args.linger, fresh=args.fresh, opener=opener))
    print(f"crash_server: the federation ended without reaching {point}:{round_}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
