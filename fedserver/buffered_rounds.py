"""The server side of buffered asynchronous rounds (``rounds.mode = "buffered"``; the pure parts are
:mod:`fedcore.buffered` and the round machine's buffered branch in :mod:`fedcore.rounds`).

Two jobs the round machine cannot do because they hold tensors or files:

- :class:`ModelVersions`: the global model of every round a device in flight was handed, kept as a model of
  :class:`~fedserver.global_models.GlobalModels` under ``version-<round>`` until no device trains from it (so an
  update sent as weights is turned into ``u_i = w_i - w_base`` against the model it was trained from, and the
  versions are saved and restored with the snapshot: a resumed server still takes the updates of devices that kept
  training through its crash);
- :class:`ArrivalLog`: ``arrivals.jsonl`` in the run directory, one line per task delivered and per update buffered,
  in the order they happened -- what ``rounds.replay`` follows to reproduce a run's models bit for bit;
- :class:`BufferJournal`: every update accepted into the open buffer, written to the state store
  (``buffer_updates`` in ``state.db``) before it is acknowledged, so a server killed mid-buffer re-folds them, in
  their arrival order, into the same buffer when it resumes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from fedcore import buffered as bf
from fedcore import rounds as rm
from fedcore.update_report import UpdateReport
from fedserver.global_models import GLOBAL, GlobalModels
from fedserver.store import DB_NAME, StateStore, StoreError, ways_on

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


@dataclass(frozen=True)
class BufferedUpdate:
    """An update of the open buffer as the store kept it: the float32 [P] vector the aggregator was given (already
    scaled by its staleness weight), and what the round's log keeps of it."""

    client_id: str
    base: int
    flat: torch.Tensor
    report: UpdateReport
    nbytes: int
    staleness: int


class BufferJournal:
    """The open buffer's updates in the state store (``store()``: None when persistence is off, then nothing is
    kept). :meth:`record` runs before the update is folded and acknowledged: once the device is told its update
    was taken, the update survives a ``kill -9``; :meth:`load` reads them back for the buffer a resumed server
    fills again."""

    def __init__(self, store: Callable[[], StateStore | None]) -> None:
        self._store = store

    def record(self, round_: int, attempt: int, u: BufferedUpdate) -> int | None:
        """Write ``u`` (one committed SQLite transaction); its row id, or None without a store."""
        store = self._store()
        if store is None:
            return None
        flat = u.flat.detach().to(torch.float32).contiguous().reshape(-1)
        meta = {"report": dataclasses.asdict(u.report), "nbytes": u.nbytes, "staleness": u.staleness,
                "numel": int(flat.numel())}
        return store.put_buffered(round_, attempt, u.client_id, u.base, meta, flat.numpy().tobytes())

    def forget(self, row_id: int | None) -> None:
        """The update recorded as ``row_id`` was not taken after all (the aggregator refused it)."""
        store = self._store()
        if store is not None and row_id is not None:
            store.drop_buffered(row_id)

    def load(self, round_: int, attempt: int, num_params: int) -> list[BufferedUpdate]:
        """The updates kept for round ``round_``'s buffer, in arrival order. A row that does not decode (a
        hand-edited or damaged ``state.db``) is a :class:`StoreError` naming it and the ways on."""
        store = self._store()
        if store is None:
            return []
        out: list[BufferedUpdate] = []
        for row_id, client_id, base, meta_text, blob in store.buffered(round_, attempt):
            try:
                out.append(_decode(client_id, base, meta_text, blob, num_params))
            except (KeyError, TypeError, ValueError) as e:
                what = f"missing {e}" if isinstance(e, KeyError) else str(e)
                raise StoreError(f"{store.directory / DB_NAME}: buffered update {row_id} of round {round_} does not "
                                 f"decode ({what[:300]}); {ways_on(store.directory)}") from None
        return out


def _decode(client_id: Any, base: Any, meta_text: Any, blob: Any, num_params: int) -> BufferedUpdate:
    if not isinstance(client_id, str) or isinstance(base, bool) or not isinstance(base, int):
        raise TypeError("client_id or base of the wrong type")
    meta = json.loads(meta_text)
    if not isinstance(meta, dict) or not isinstance(meta["report"], dict):
        raise TypeError("meta: not a JSON object with a report")
    if not isinstance(blob, bytes) or meta["numel"] != num_params or len(blob) != 4 * num_params:
        raise ValueError(f"tensor of {len(blob) if isinstance(blob, bytes) else '?'} bytes, the model has "
                         f"{num_params} float32 parameters")
    report = UpdateReport(**meta["report"])
    flat = torch.frombuffer(bytearray(blob), dtype=torch.float32)
    return BufferedUpdate(client_id, base, flat, report, int(meta["nbytes"]), int(meta["staleness"]))
