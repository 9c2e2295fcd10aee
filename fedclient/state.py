"""A client's state directory: one versioned state file, written whole or not at all.

What a client keeps across restarts -- its identity, Pᵢ of its private model, its individual-level NFL counters --
lives in ``STATE_FILE`` (JSON with ``format`` and ``version``; written to a temp name, synced, renamed over the old
file, the directory synced), so a crash or a power cut leaves the previous state or the new one, never a mix. The
trainer state (vᵢ and other tensors, :func:`fedcore.train.trainers.save_trainer_state`) stays a tensor file of its
own, named in the state file.

Layout (version 1)::

    state_dir/client_state.json    {"format": "fedguard.client_state", "version": 1, "client_id": ...,
                                    "private_model": {"fingerprint", "accuracy", "epochs", "trained_as"} | null,
                                    "individual": {...} | null, "files": {"trainer_state": "trainer_state.fgt"}}
    state_dir/trainer_state.fgt    the trainer state (written after each round)
    state_dir/compression_residual.fgt  compressed updates' error-feedback residual (float32 [P], with the kind and
                                   model it belongs to; written at each round's encoding, absent without one)

A state dir in the old layout (``client.json``, ``private_model.fgt``, ``individual_nfl.json`` and
``trainer_state.fgt``, one file per concern) is read and migrated when the client opens it: the state file is
written and synced first, and only then are the three migrated files removed. A file that cannot be read, or one
written by a newer fedguard, stops the client with :class:`ClientStateError` naming the file and the ways on; nothing
is overwritten or removed then (the state is the client's history: it is never reset silently).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedcore.metrics import PRIVATE_MODEL_FILE, load_private_model
from fedcore.nfl.individual import INDIVIDUAL_STATE_FILE, IndividualState, load_individual_state
from fedcore.serialization import SerializationError, atomic_write, fingerprint, load_state, manifest_of, save_state
from fedcore.train.trainers import TRAINER_STATE_FILE, TrainerState, load_trainer_state, save_trainer_state

STATE_FILE = "client_state.json"
# Compressed updates' error-feedback residual (fedcore.compression.device): its own tensor file, like the trainer's.
RESIDUAL_FILE = "compression_residual.fgt"
RESIDUAL_TENSOR = "residual"
FORMAT = "fedguard.client_state"
VERSION = 1

# The old layout's files that the state file replaces (the trainer state keeps its file).
LEGACY_ID_FILE = "client.json"
LEGACY_PRIVATE_MODEL_FILE = PRIVATE_MODEL_FILE
LEGACY_FILES = (LEGACY_ID_FILE, LEGACY_PRIVATE_MODEL_FILE, INDIVIDUAL_STATE_FILE)
# Where a migration moves the old layout's files (kept, never read again).
LEGACY_DIR = "legacy-layout"


class ClientStateError(RuntimeError):
    """The state directory cannot be used as it is (the message names the file and the ways on; nothing was
    overwritten or removed)."""


@dataclass(frozen=True)
class PrivateModelRecord:
    """Pᵢ, the accuracy of the client's stand-alone model, and what it was trained as: it is reused only for a model
    of the same ``fingerprint`` (parameter names, dtypes and shapes) trained as ``trained_as``
    (:func:`fedcore.metrics.private_model_key`: the data, training settings, epochs and seed; "" in records written
    before it was kept, which are never reused)."""

    fingerprint: str
    accuracy: float
    epochs: int = 0
    trained_as: str = ""


@dataclass(frozen=True)
class ClientStateDoc:
    """The contents of the state file (version :data:`VERSION`)."""

    client_id: str = ""
    private_model: PrivateModelRecord | None = None
    individual: IndividualState | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "client_id": self.client_id,
                "private_model": None if self.private_model is None else dataclasses.asdict(self.private_model),
                "individual": None if self.individual is None else self.individual.to_dict(),
                "files": {"trainer_state": TRAINER_STATE_FILE}}

    @classmethod
    def from_json(cls, doc: object) -> ClientStateDoc:
        """The document, or :class:`ValueError` saying what is wrong (``format``/``version`` checked by the caller)."""
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        cid = doc.get("client_id", "")
        if not isinstance(cid, str):
            raise ValueError(f"client_id: expected a string, got {cid!r}")
        files = doc.get("files", {})
        if not isinstance(files, dict) or files.get("trainer_state", TRAINER_STATE_FILE) != TRAINER_STATE_FILE:
            raise ValueError(f"files: expected {{'trainer_state': {TRAINER_STATE_FILE!r}}}, got {files!r}")
        return cls(cid, _private_record(doc.get("private_model")), _individual(doc.get("individual")))


def _private_record(raw: object) -> PrivateModelRecord | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"private_model: expected an object or null, got {raw!r}")
    fp, acc, epochs = raw.get("fingerprint"), raw.get("accuracy"), raw.get("epochs", 0)
    trained_as = raw.get("trained_as", "")
    if not isinstance(fp, str) or isinstance(acc, bool) or not isinstance(acc, (int, float)) \
            or not math.isfinite(acc) or isinstance(epochs, bool) or not isinstance(epochs, int) \
            or not isinstance(trained_as, str):
        raise ValueError(f"private_model: expected fingerprint (string), accuracy (number), epochs (integer), "
                         f"trained_as (string), got {raw!r}")
    return PrivateModelRecord(fp, float(acc), epochs, trained_as)


def _individual(raw: object) -> IndividualState | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"individual: expected an object or null, got {raw!r}")
    try:
        return IndividualState.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"individual.{e}") from None


def _ways_on(path: Path) -> str:
    return (f"ways on: restore {path.name} from a backup; or move {path.parent} aside to start this client afresh "
            "(a new identity unless it has a client_id, its private model retrained, its NFL counters and adapted "
            "model lost)")


def read_state_file(path: Path) -> ClientStateDoc:
    """The state file at ``path``; :class:`ClientStateError` for one that cannot be read or is of a newer version."""
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ClientStateError(f"{path}: unreadable client state ({e}); {_ways_on(path)}") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(version, int):
        raise ClientStateError(f"{path}: not a fedguard client state file (no format {FORMAT!r} with an integer "
                               f"version); {_ways_on(path)}")
    if version > VERSION:
        raise ClientStateError(f"{path}: client state version {version} was written by a newer fedguard (this one "
                               f"reads version {VERSION}); ways on: run the newer fedguard with this state dir, or "
                               f"move {path.parent} aside to start this client afresh")
    if version < 1:
        raise ClientStateError(f"{path}: unknown client state version {version}; {_ways_on(path)}")
    try:
        return ClientStateDoc.from_json(doc)
    except ValueError as e:
        raise ClientStateError(f"{path}: corrupt client state ({e}); {_ways_on(path)}") from None


def write_state_file(path: Path, doc: ClientStateDoc) -> None:
    """Write ``doc`` to ``path`` whole or not at all, and sync the directory so the rename survives a power cut."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(doc.to_json(), indent=1).encode()
    with atomic_write(path) as f:
        f.write(data)
    _sync_dir(path.parent)


def _sync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform lets a directory be opened and synced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_legacy(state_dir: Path) -> ClientStateDoc:
    """The state kept in the old layout's files (:data:`LEGACY_FILES`) of ``state_dir``; an unreadable one is a
    :class:`ClientStateError` naming it."""
    doc = ClientStateDoc()
    id_path = state_dir / LEGACY_ID_FILE
    if id_path.exists():
        try:
            raw = json.loads(id_path.read_text())
            cid = raw["client_id"]
            if not isinstance(cid, str):
                raise TypeError(f"client_id is {cid!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ClientStateError(f"{id_path}: unreadable client identity ({e}); {_ways_on(id_path)}") from None
        doc = dataclasses.replace(doc, client_id=cid)
    private_path = state_dir / LEGACY_PRIVATE_MODEL_FILE
    try:
        private = load_private_model(state_dir)
    except (OSError, ValueError, SerializationError) as e:
        raise ClientStateError(f"{private_path}: unreadable private model ({e}); {_ways_on(private_path)}") from None
    if private is not None:  # the old file did not say how many epochs (0: unknown)
        doc = dataclasses.replace(doc, private_model=PrivateModelRecord(_fingerprint(private[0]), private[1]))
    if (state_dir / INDIVIDUAL_STATE_FILE).exists():
        try:
            doc = dataclasses.replace(doc, individual=load_individual_state(state_dir))
        except ValueError as e:
            raise ClientStateError(f"{e}; {_ways_on(state_dir / INDIVIDUAL_STATE_FILE)}") from None
    return doc


def _fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    return fingerprint(manifest_of(state))


class ClientState:
    """One client's durable state (thread-safe). ``state_dir`` None or "": kept in memory only (nothing written).

    Open with :meth:`open`; every change is written through at once (the state file is a few hundred bytes)."""

    def __init__(self, state_dir: str | os.PathLike[str] | None, doc: ClientStateDoc | None = None) -> None:
        self.dir = Path(state_dir) if state_dir else None
        self._doc = doc or ClientStateDoc()
        self._lock = threading.Lock()

    @property
    def path(self) -> Path | None:
        return None if self.dir is None else self.dir / STATE_FILE

    @classmethod
    def open(cls, state_dir: str | os.PathLike[str] | None, log: Any = None) -> ClientState:
        """The state of ``state_dir``: its state file, else its old layout migrated, else a new, empty state (the
        file is written at the first change)."""
        if not state_dir:
            return cls(None)
        directory = Path(state_dir)
        path = directory / STATE_FILE
        if path.exists():
            return cls(directory, read_state_file(path))
        legacy = [directory / name for name in LEGACY_FILES if (directory / name).exists()]
        if not legacy:
            return cls(directory)
        doc = read_legacy(directory)
        write_state_file(path, doc)  # synced before anything old is moved
        # The old files are kept, moved aside (the new layout no longer stores the private model's weights: deleting
        # private_model.fgt would lose them); a second migration's files never overwrite the first's.
        aside = directory / LEGACY_DIR
        aside.mkdir(exist_ok=True)
        for old in legacy:
            target = aside / old.name
            n = 1
            while target.exists():
                target = aside / f"{old.name}.{n}"
                n += 1
            os.rename(old, target)
        _sync_dir(directory)
        if log is not None:
            log.info("client_state.migrated", state_dir=str(directory), file=STATE_FILE,
                     replaced=[p.name for p in legacy])
        return cls(directory, doc)

    @property
    def doc(self) -> ClientStateDoc:
        with self._lock:
            return self._doc

    def _update(self, **changes: Any) -> None:
        with self._lock:
            self._doc = dataclasses.replace(self._doc, **changes)
            if self.path is not None:
                write_state_file(self.path, self._doc)

    # ---- identity ----

    def client_id(self) -> str:
        """The recorded identity; on first use a new one (``client-`` and 12 hex digits), recorded."""
        cid = self.doc.client_id
        if not cid:
            cid = f"client-{uuid.uuid4().hex[:12]}"
            self._update(client_id=cid)
        return cid

    # ---- Pᵢ ----

    def private_accuracy(self, model_fingerprint: str, trained_as: str) -> float | None:
        """Pᵢ of a private model of this fingerprint trained before as ``trained_as``
        (:func:`fedcore.metrics.private_model_key`), else None."""
        rec = self.doc.private_model
        if rec is None or not trained_as or rec.fingerprint != model_fingerprint or rec.trained_as != trained_as:
            return None
        return rec.accuracy

    def record_private_model(self, state: Mapping[str, torch.Tensor], accuracy: float, epochs: int,
                             trained_as: str = "") -> None:
        self._update(private_model=PrivateModelRecord(_fingerprint(state), float(accuracy), int(epochs), trained_as))

    # ---- individual-level NFL measures ----

    def individual(self) -> IndividualState:
        return self.doc.individual or IndividualState()

    def save_individual(self, state: IndividualState) -> None:
        self._update(individual=state)

    # ---- the trainer state (its own tensor file) ----

    def load_trainer_state(self) -> TrainerState | None:
        """The saved trainer state (None without one); :class:`fedcore.train.trainers.TrainerStateError` for a file
        that cannot be read."""
        return None if self.dir is None else load_trainer_state(self.dir)

    def save_trainer_state(self, state: TrainerState) -> None:
        if self.dir is not None:
            save_trainer_state(self.dir, state)

    # ---- compressed updates' residual (its own tensor file) ----

    def load_residual(self) -> tuple[torch.Tensor, dict[str, object]] | None:
        """The saved error-feedback residual and what it belongs to (kind, model fingerprint, P), or None;
        :class:`ClientStateError` for a file that cannot be read (it is not reset silently)."""
        if self.dir is None or not (self.dir / RESIDUAL_FILE).exists():
            return None
        path = self.dir / RESIDUAL_FILE
        try:
            tensors, meta = load_state(path)
            return tensors[RESIDUAL_TENSOR], meta
        except (OSError, SerializationError, KeyError) as e:
            raise ClientStateError(f"{path}: unreadable compression residual ({e}); ways on: restore it from a "
                                   f"backup, or delete it (the device's next update then starts without the "
                                   f"residual)") from None

    def save_residual(self, residual: torch.Tensor | None, meta: Mapping[str, object]) -> None:
        """Write the residual whole or not at all (None: remove the file)."""
        if self.dir is None:
            return
        path = self.dir / RESIDUAL_FILE
        if residual is None:
            path.unlink(missing_ok=True)
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        save_state(path, {RESIDUAL_TENSOR: residual}, meta)


__all__ = ["FORMAT", "LEGACY_FILES", "RESIDUAL_FILE", "STATE_FILE", "VERSION", "ClientState", "ClientStateDoc",
           "ClientStateError", "PrivateModelRecord", "read_legacy", "read_state_file", "write_state_file"]
