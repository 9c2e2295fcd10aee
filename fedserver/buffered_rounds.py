"""The server side of buffered asynchronous rounds (``rounds.mode = "buffered"``; the pure parts are
:mod:`fedcore.buffered` and the round machine's buffered branch in :mod:`fedcore.rounds`).

Two jobs the round machine cannot do because they hold tensors or files:

- :class:`ModelVersions`: the global model of every round a device in flight was handed, kept as a model of
  :class:`~fedserver.global_models.GlobalModels` under ``version-<round>`` until no device trains from it (so an
  update sent as weights is turned into ``u_i = w_i - w_base`` against the model it was trained from, and the
  versions are saved and restored with the snapshot: a resumed server still takes the updates of devices that kept
  training through its crash);
- :class:`ArrivalLog`: ``arrivals.jsonl`` in the run directory, one line per task delivered and per update buffered,
  in the order they happened -- what ``rounds.replay`` follows to reproduce a run's models bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from fedcore import buffered as bf
from fedcore import rounds as rm
from fedserver.global_models import GLOBAL, GlobalModels

VERSION_PREFIX = "version-"


def version_id(round_: int) -> str:
    """The model id of round ``round_``'s model (the global model while that round's buffer filled)."""
    return f"{VERSION_PREFIX}{round_}"


def is_version(model_id: str) -> bool:
    return model_id.startswith(VERSION_PREFIX)


class ModelVersions:
    def __init__(self, models: GlobalModels) -> None:
        self.models = models

    def opened(self, round_: int, state: rm.RoundState) -> None:
        """Round ``round_``'s buffer opened: its model (the global model now) is kept; versions no device trains from
        any more are dropped."""
        self.models.put(version_id(round_), self.models.get(GLOBAL))
        self.prune(state)

    def prune(self, state: rm.RoundState) -> None:
        keep = {version_id(state.round)}
        if state.buffered is not None:
            keep.update(version_id(r) for r in state.buffered.flight.values())
        for model_id in self.models.ids():
            if is_version(model_id) and model_id not in keep:
                self.models.drop(model_id)


class ArrivalLog:
    """Appends the round machine's :class:`~fedcore.rounds.TaskHanded` and :class:`~fedcore.rounds.UpdateBuffered`
    events to ``<run_dir>/arrivals.jsonl`` (flushed per line: a crash loses at most the line being written)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / bf.ARRIVALS_FILE
        self._file: IO[str] | None = None

    def resumed(self, completed_rounds: int) -> int:
        """A restarted server goes on from its snapshot of ``completed_rounds``: the lines of later rounds (the
        buffer that was being filled, lost with the process) are dropped, so the log matches the state; the file is
        replaced atomically. Returns the lines dropped."""
        if not self.path.exists():
            return 0
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = [line for line in lines if _round_of(line) <= completed_rounds]
        if len(kept) != len(lines):
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")
            tmp.replace(self.path)
        return len(lines) - len(kept)

    def write(self, ev: rm.Event) -> None:
        if isinstance(ev, rm.TaskHanded):
            line = bf.hand_line(ev.client_id, ev.round)
        elif isinstance(ev, rm.UpdateBuffered):
            line = bf.arrive_line(ev.client_id, ev.base, ev.round, ev.seq)
        else:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _round_of(line: str) -> int:
    """The round of an arrival-log line (a torn last line, written when the process died: past every round)."""
    try:
        return int(json.loads(line)["round"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62
