"""Durability of a federation: resume from the run directory's state store, snapshot every completed round.

What a snapshot holds (everything needed to carry on, see :meth:`Persistence.snapshot`): the round machine's
state with the client registry, every model by id, the metrics history (the rounds' reports), and one slot per
registered server-side state machine (``register_slot(name, save, load)``: NFL detectors, clusters). Server
randomness needs no saved RNG state: every draw is seeded by (seed, round, attempt, purpose).

On start, :meth:`Persistence.restore` loads the newest snapshot that verifies, refuses a configuration that would
change the federation (naming the field), and re-appends to ``rounds.jsonl`` any round the file is missing.
``fresh`` moves the old state aside into ``run_dir/previous/<time>/`` instead (``run_dir/state.broken-<time>/``
when the old state cannot be read).

Never a silent new federation: a damaged or unreadable ``state.db``, a store whose snapshots all fail
verification, or a ``rounds.jsonl`` with rounds but no state raise :class:`~fedserver.store.StoreError` (the
server stops with exit 2 and one message naming the file, what failed and the ways on). When the newest snapshots
fail verification but an older one verifies, the server stops the same way unless ``persistence.fall_back``
(``--fall-back``) says to resume from the older one; the unverified snapshots then move into
``state/quarantine/<time>/``, kept.

The metrics history is appended to the store (only the rounds a snapshot adds), so a snapshot costs O(1) in the
number of rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedcore import jsonio
from fedcore import rounds as rm
from fedcore.config import ConfigError, PersistenceConfig, ServerConfig, current_shape, redacted
from fedcore.log import get_logger
from fedcore.report import RoundReport
from fedserver.global_models import GlobalModels
from fedserver.store import (
    DB_NAME,
    Snapshot,
    StateStore,
    StoreError,
    archive,
    newest_unverified,
    no_verifiable_snapshot,
    ways_on,
)

STATE_DIR = "state"
# What --fresh moves aside (a new federation must not inherit them): the server's files, and the state of the
# launcher's clients (fedlaunch.hosts.CLIENT_STATE_DIR: Pᵢ, NFL counters, trainer state), which a resume reads.
RUN_FILES = ("state", "rounds.jsonl", "arrivals.jsonl",
             "config.json", "final_model.fgt", "final_model.safetensors", "final_model.json",
             "final_clusters", "client_state")
# Configuration sections and fields that define the federation: a resumed run must keep them.
IDENTITY = ("model", "data", "training", "aggregation", "rounds.seed", "rounds.clients_per_round",
            "rounds.over_select", "rounds.mode", "nfl.mode", "nfl.detector", "server_optimizer")
# What an identity section added later is in a run directory written before it existed.
IDENTITY_DEFAULTS: dict[str, Any] = {"server_optimizer": {"name": "", "options": {}}, "rounds.mode": "sync"}

Slot = tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]
TensorSlot = tuple[Callable[[], dict[str, torch.Tensor]], Callable[[dict[str, torch.Tensor]], None]]
# A tensor slot's tensors travel in the snapshot as one more tensor file, under this prefix and the slot's name
# (the models' ids are "global" and DistFL's cluster ids, never with a dot).
TENSOR_SLOT_PREFIX = "stage."
# Opens the state store of a run directory (``<run_dir>/state``): the seam where the fault tests put a store
# that dies at a chosen point of a save (tests/crash_server.py); production uses :func:`open_store`.
StoreOpener = Callable[[Path, PersistenceConfig], StateStore]


def open_store(directory: Path, p: PersistenceConfig) -> StateStore:
    return StateStore(directory, keep=p.keep_snapshots, fsync=p.fsync)


@dataclass(frozen=True)
class Restored:
    round_state: rm.RoundState
    history: list[RoundReport]
    completed_rounds: int


class Persistence:
    def __init__(self, config: ServerConfig, models: GlobalModels, opener: StoreOpener = open_store) -> None:
        self.config = config
        self.models = models
        self._open_store = opener
        self.run_dir = Path(config.server.run_dir)
        self.store: StateStore | None = None  # opened by restore(), after --fresh moved old files aside
        self._slots: dict[str, Slot] = {}
        self._tensor_slots: dict[str, TensorSlot] = {}
        self.log = get_logger("fedserver")
        self.last_save_seconds = 0.0
        self._saved_history = 0  # history reports the store has (a snapshot appends only the ones after them)
        # The round machine whose registry was serialized last, its registry_version then, and the JSON text.
        self._registry: tuple[rm.RoundState, int, str] | None = None

    # ---- slots ----

    def register_slot(self, name: str, save: Callable[[], dict[str, Any]],
                      load: Callable[[dict[str, Any]], None]) -> None:
        """A server-side state machine's state travels with every snapshot under ``name``."""
        if name in self._slots:
            raise ValueError(f"state slot {name!r} is already registered")
        self._slots[name] = (save, load)

    def register_tensor_slot(self, name: str, save: Callable[[], dict[str, torch.Tensor]],
                             load: Callable[[dict[str, torch.Tensor]], None]) -> None:
        """A server-side stage's tensors (a server optimizer's moments) travel with every snapshot under ``name``,
        as one verified tensor file; on resume ``load`` gets them after every JSON slot was loaded, or an empty dict
        when the snapshot holds none for the slot (``save`` returned none); ``load`` raises
        :class:`~fedserver.store.StoreError` when its JSON state says there should have been some."""
        if name in self._tensor_slots:
            raise ValueError(f"tensor slot {name!r} is already registered")
        self._tensor_slots[name] = (save, load)

    # ---- start ----

    @staticmethod
    def start_fresh(run_dir: Path) -> Path | None:
        """Move an earlier federation's files aside (never deleted); returns where they went: ``previous/<time>/``,
        or ``state.broken-<time>/`` when the old state cannot be read."""
        try:
            StateStore.exists(run_dir / STATE_DIR)
            broken = False
        except StoreError:
            broken = True
        try:
            return archive(run_dir, RUN_FILES, prefix="state.broken-" if broken else None)
        except OSError as e:
            raise StoreError(f"{e.filename or run_dir}: --fresh cannot move the old state aside ({e.strerror or e}); "
                             "nothing was deleted") from None

    def restore(self, now: float) -> Restored | None:
        """The state to carry on from, or None for a new federation (which this call then records). Raises
        :class:`StoreError` (with the store closed, so its files are as they were) when the state cannot be
        carried on, and :class:`ConfigError` for a configuration that would change the federation."""
        try:
            return self._restore(now)
        except BaseException:
            self.close()
            raise

    def _restore(self, now: float) -> Restored | None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.run_dir}: cannot create the run directory ({e.strerror or e})") from None
        p = self.config.persistence
        if p.enabled and self.store is None:
            self.store = self._open_store(self.run_dir / STATE_DIR, p)
        if self.store is None:
            self._write_config()
            return None
        loaded = self.store.load()
        state_dir = self.run_dir / STATE_DIR
        snap = loaded.snapshot
        if snap is None and loaded.skipped:
            raise no_verifiable_snapshot(state_dir, loaded.skipped)
        if snap is not None and loaded.skipped:
            if not p.fall_back:
                raise newest_unverified(state_dir, loaded.skipped, snap.completed_rounds)
            for line in loaded.skipped:
                self.log.error("state.snapshot_skipped", reason=line)
            moved = self.store.quarantine(loaded.skipped_ids, max(0, snap.history_len))
            self.log.warning("state.fell_back", completed_rounds=snap.completed_rounds, quarantine=str(moved),
                             reason="--fall-back: the unverified newer snapshots were moved aside, not deleted")
        self.store.clean_pending()  # carrying on: the leftovers of an uncommitted save can go
        if snap is None:
            orphan_rows = _rounds_in(self.run_dir / "rounds.jsonl")
            if orphan_rows:
                raise StoreError(f"{self.run_dir / 'rounds.jsonl'} holds {orphan_rows} rounds of a federation whose "
                                 f"state ({state_dir}) holds no snapshot: starting a new federation here would mix two "
                                 f"federations in one file. Nothing was changed. Ways on: restore {state_dir} from a "
                                 f"copy, or start with --fresh, which moves the old files aside to "
                                 f"{self.run_dir}/previous/<time>/ (kept)")
            self.store.put_meta("config", redacted(self.config))
            self._write_config()
            self.snapshot(rm.RoundState(phase_since=now), [], 0)  # round 0: the initial model
            return None
        stored = self.store.get_meta("config") or {}
        check_identity(current_shape(stored), json.loads(json.dumps(redacted(self.config))))
        stage_tensors: dict[str, dict[str, torch.Tensor]] = {}
        for model_id, tensors in snap.models.items():
            if model_id.startswith(TENSOR_SLOT_PREFIX):
                stage_tensors[model_id.removeprefix(TENSOR_SLOT_PREFIX)] = dict(tensors)
            else:
                self.models.put(model_id, tensors)
        round_state, history = decode_snapshot(snap, loaded.history, loaded.progress, self.config.rounds, now,
                                               state_dir)
        for name, value in snap.state.get("slots", {}).items():
            if name in self._slots:
                self._slots[name][1](value)
        for name, tensors in sorted(stage_tensors.items()):
            if name not in self._tensor_slots:
                raise ConfigError("pipeline.stages", f"the snapshot of round {snap.completed_rounds} holds the "
                                                     f"tensors of stage {name!r}, which this configuration does not "
                                                     "run; resume with the stage, or start over with --fresh")
            self._tensor_slots[name][1](tensors)
        for name in sorted(set(self._tensor_slots) - set(stage_tensors)):
            self._tensor_slots[name][1]({})  # none in the snapshot: the stage says whether its state allows that
        self._saved_history = len(history) if snap.history_len >= 0 else 0
        self._append_missing_rows(history)
        self.log.info("federation.resumed", completed_rounds=snap.completed_rounds, round=round_state.round,
                      attempt=round_state.attempt, phase=round_state.phase, clients=len(round_state.clients))
        return Restored(round_state, history, snap.completed_rounds)

    def _write_config(self) -> None:
        path = self.run_dir / "config.json"
        try:
            path.write_text(jsonio.dumps(redacted(self.config), indent=2))
            (self.run_dir / "rounds.jsonl").touch()
        except OSError as e:
            raise StoreError(f"{e.filename or path}: cannot write the new federation's files "
                             f"({e.strerror or e}); fix the cause and start again") from None

    def _append_missing_rows(self, history: list[RoundReport]) -> None:
        """Rounds the store has but ``rounds.jsonl`` lacks (a crash between the commit and the append)."""
        path = self.run_dir / "rounds.jsonl"
        last = 0
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    last = max(last, int(json.loads(line)["round"]))
                except (ValueError, KeyError, TypeError):
                    continue
        if history and last > history[-1].round:
            self.log.warning("state.rounds_file_ahead", rounds_file_round=last, restored_round=history[-1].round,
                             reason="rounds.jsonl has rows past the restored snapshot; re-run rounds are "
                                    "appended after them")
        missing = [r for r in history if r.round > last]
        for r in missing:
            write_round(self.run_dir, r)

    # ---- every round ----

    def snapshot(self, state: rm.RoundState, history: list[RoundReport], completed_rounds: int) -> None:
        """Persist a completed round (blocking file IO: run it in a worker thread)."""
        if self.store is None:
            return
        body = {
            "round_state": state.to_saved(),
            "slots": {name: save() for name, (save, _) in sorted(self._slots.items())},
        }
        start = min(self._saved_history, len(history))
        tail = [r.to_dict() for r in history[start:]]
        models = self.models.all()
        for name, (save_tensors, _) in sorted(self._tensor_slots.items()):
            tensors = save_tensors()
            if tensors:
                models[TENSOR_SLOT_PREFIX + name] = tensors
        snap = Snapshot(completed_rounds, body, models, history_len=len(history),
                        state_text=self.state_text(state, body))
        stats = self.store.save(snap, tail)
        self._saved_history = len(history)
        self.last_save_seconds = stats.seconds

    def state_text(self, state: rm.RoundState, body: dict[str, Any]) -> str:
        """``json.dumps(body)``, character for character, with the registry (the round state's last key,
        ``clients``) serialized again only when ``state.registry_version`` moved since the last snapshot: between
        joins a fleet's registry is the same every round (1,000 clients: ~0.2 ms of JSON a round)."""
        round_state = body.get("round_state")
        if list(body) != ["round_state", "slots"] or not isinstance(round_state, dict) \
                or list(round_state)[-1:] != ["clients"]:
            return json.dumps(body)  # not a snapshot's layout: nothing to splice
        cached = self._registry
        if cached is None or cached[0] is not state or cached[1] != state.registry_version:
            cached = self._registry = (state, state.registry_version, json.dumps(round_state["clients"]))
        head = json.dumps({k: v for k, v in round_state.items() if k != "clients"})
        head = f"{head[:-1]}, " if head != "{}" else "{"
        return f'{{"round_state": {head}"clients": {cached[2]}}}, "slots": {json.dumps(body["slots"])}}}'

    def progress(self, state: rm.RoundState) -> None:
        """Record the round machine between snapshots (an abandoned attempt, a stop) so a restart re-runs
        the in-flight round with the same attempt counter."""
        if self.store is not None:
            self.store.put_progress({"round_state": state.to_saved()})

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def decode_snapshot(snap: Snapshot, history_rows: list[dict[str, Any]], progress: dict[str, Any] | None,
                    rounds: rm.RoundsConfig, now: float, state_dir: Path) -> tuple[rm.RoundState, list[RoundReport]]:
    """The round machine's state (from the progress record, else the snapshot's), made ready to carry on, and the
    metrics history of a verified snapshot. Its rows are JSON objects but not necessarily what a server wrote (a
    hand-edited or damaged ``state.db``): one that does not decode is a :class:`StoreError` naming the snapshot."""
    try:
        if not isinstance(snap.state.get("slots", {}), dict):
            raise TypeError("slots: not a JSON object")
        rows = history_rows if snap.history_len >= 0 else snap.state.get("history", [])
        if not isinstance(rows, list) or not all(isinstance(d, dict) for d in rows):
            raise TypeError("history: not a list of JSON objects")
        history = [RoundReport.from_dict(d) for d in rows]
        for i, report in enumerate(history):
            _check_fields(report, f"history[{i}]")
        raw = (progress or {}).get("round_state") or snap.state["round_state"]
        if not isinstance(raw, dict):
            raise TypeError("round_state: not a JSON object")
        state = rm.RoundState.from_dict(raw)
        _check_fields(state, "round_state")
        for cid, record in state.clients.items():
            _check_fields(record, f"round_state.clients[{cid!r:.40}]")
        state = (rm.resume_buffered if rounds.buffered else rm.resume)(state, snap.completed_rounds, rounds, now)
    except (KeyError, TypeError, ValueError) as e:
        what = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise StoreError(f"{state_dir / DB_NAME}: the snapshot of round {snap.completed_rounds} does not decode "
                         f"({what[:300]}); {ways_on(state_dir)}") from None
    return state, history


# JSON's types for the dataclass fields of plain types (a float field takes an integer; a bool is no number).
_JSON_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def _check_fields(obj: Any, where: str) -> None:
    """Raise TypeError naming the field when a decoded dataclass holds a value of another JSON type than its
    field's (``"round": "off"`` decodes, then breaks the server that compares rounds)."""
    for f in dataclasses.fields(obj):
        kinds = _JSON_TYPES.get(f.type) if isinstance(f.type, str) else None
        value = getattr(obj, f.name)
        if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise TypeError(f"{where}.{f.name}: {value!r:.40} is not a JSON {f.type}")


def _rounds_in(path: Path) -> int:
    """How many round rows ``rounds.jsonl`` holds (0 when it is missing or empty)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except FileNotFoundError:
        return 0
    except OSError as e:
        raise StoreError(f"{path}: cannot be read ({e.strerror or e})") from None


def write_round(run_dir: Path, report: RoundReport) -> None:
    """Append the round's row to ``rounds.jsonl`` as strict JSON (NaN as ``null``, :mod:`fedcore.jsonio`); a row
    cut short by an earlier failed write is ended first, so rows never run together. A failed write (disk full) is
    a :class:`StoreError`: the round is in the store already and its row is re-appended on the next start."""
    path = run_dir / "rounds.jsonl"
    try:
        with open(path, "ab+") as f:
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")
            f.write((jsonio.dumps(report.to_dict()) + "\n").encode())
    except OSError as e:
        raise StoreError(f"{path}: cannot append round {report.round} ({e.strerror or e}). The round is saved in the "
                         "state store and its row is written again on the next start: fix the cause (free disk "
                         "space) and start the server again") from None


def check_identity(stored: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse a configuration that changes what the stored federation is (raises :class:`ConfigError`)."""
    for path in IDENTITY:
        old, new = _get(stored, path), _get(current, path)
        if old is None and path in IDENTITY_DEFAULTS:
            old = IDENTITY_DEFAULTS[path]
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    _refuse(f"{path}.{key}", old.get(key), new.get(key))
        elif old != new:
            _refuse(path, old, new)


def _get(d: dict[str, Any], path: str) -> Any:
    node: Any = d
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _refuse(path: str, old: Any, new: Any) -> None:
    raise ConfigError(path, f"was {old!r} when this federation started, now {new!r}: resuming would change the "
                            "federation; use the original value, or start over with --fresh (the old state is "
                            "moved aside)")
