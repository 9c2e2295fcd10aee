"""A durable snapshot store for the coordinator: a crashed server (``kill -9`` at any instant) resumes from its
last completed round.

Layout of ``<run_dir>/state/``::

    state.db                                   SQLite (WAL): snapshots, their models, progress, meta
    models/r{round:06d}-{model_id}-{nonce}.fgt  one file per model per snapshot (fedcore.serialization format)

A snapshot is the coordinator's JSON state (round machine, clients, history, state machines' slots) plus every
model by id. :meth:`StateStore.save` writes the model files first (temp name + rename, sha256 computed while
writing), then commits ONE SQLite transaction that records the snapshot with each file's path, size and
sha256 and drops the snapshots beyond the newest ``keep``; only then are the dropped snapshots' files unlinked.
A crash at any instant therefore leaves either the previous committed set of snapshots or the new one, plus
perhaps files that no row references (temp files, the files of an uncommitted save, the files of a pruned
snapshot).

Never destroy state. Before a save writes a model file it records the file's name in the ``pending`` table (its
own committed transaction): on the next open, only files named there that no snapshot references are removed, so
the store deletes nothing it did not write itself. A snapshot is dropped only when a newer snapshot of the same
timeline was committed (the ``keep`` newest stay); a save that would supersede a newer snapshot (another
timeline) is refused. On open the database passes SQLite's ``quick_check`` before anything writes to it: a
damaged ``state.db`` raises :class:`StoreError` (the server stops with exit 2 naming the file and the ways on)
and nothing is changed.

The metrics history is a table of its own, appended to (one row per completed round) in the transaction of the
save that adds it, so a snapshot costs O(1) in the number of rounds; a snapshot records how many history rows
it covers (``history_len``).

:meth:`StateStore.load` returns the newest snapshot whose every model file exists, has the recorded size and
sha256 and parses; a newer snapshot that fails (a file half-written before a power cut without ``fsync``, a
disk error, a hand-edited file) is reported in :attr:`Loaded.skipped` and the next older one is tried. The
caller decides what to do about skipped ones: :meth:`StateStore.quarantine` moves them (rows and files) into
``quarantine/<time>/`` before a federation carries on from the older one; nothing is deleted.

Durability: with ``fsync=False`` (the default) every completed save survives a crash of the server process,
since the bytes are in the kernel's page cache before the commit; with ``fsync=True`` model files and their
directory are fsynced before the commit and SQLite runs with ``synchronous=FULL``, so a committed snapshot also
survives a power cut. Without fsync a power cut can lose the newest snapshots or leave them unverifiable: the
checksums make ``load`` fall back to an older one rather than resume from damaged weights.

No pickle: the state is JSON, the tensors are raw little-endian bytes behind a JSON manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedserver.snapshot_files import (
    MODELS_DIR,
    TMP_SUFFIX,
    Unverified,
    parse_history,
    parse_state,
    store_file,
    verify_models,
)

# torch (and fedcore.serialization, which needs it) is imported where tensors are read or written, so that
# fedserver can check a run directory's state (check_state) before it pays for importing torch.
if TYPE_CHECKING:
    import torch

DB_NAME = "state.db"
# PRAGMA application_id of a fedguard state store ("FGST"), and the schema version in PRAGMA user_version.
APPLICATION_ID = 0x46475354
SCHEMA_VERSION = 2
QUARANTINE_DIR = "quarantine"
MODEL_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshots (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    completed_rounds INTEGER NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS models (
    snapshot_id INTEGER NOT NULL,
    model_id TEXT NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    PRIMARY KEY (snapshot_id, model_id)
);
CREATE TABLE IF NOT EXISTS progress (
    snapshot_id INTEGER PRIMARY KEY,
    state TEXT NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS history (
    seq INTEGER PRIMARY KEY,
    report TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS pending (
    path TEXT PRIMARY KEY
);
"""
# Buffered rounds (rounds.mode = "buffered"): each update accepted into the open buffer, durable before it is
# acknowledged (fedserver.buffered_rounds.BufferJournal). Created by the first such update (a sync federation's
# store never has it; older fedguards ignore it); a snapshot drops the rows of the rounds it completes. A row names
# the snapshot it was written after: a resumed server reads only those of the snapshot it resumes from (the rows of
# a timeline abandoned by --fall-back are not taken; they go once a snapshot completes their round).
_BUFFER_TABLE = """CREATE TABLE IF NOT EXISTS buffer_updates (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    after_snapshot INTEGER NOT NULL,
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    client_id TEXT NOT NULL,
    base INTEGER NOT NULL,
    meta TEXT NOT NULL,
    tensor BLOB NOT NULL
)"""
# Schema 1 -> 2: snapshots record how many history rows they cover (-1: the history is inside their state JSON).
_MIGRATE_2 = "ALTER TABLE snapshots ADD COLUMN history_len INTEGER NOT NULL DEFAULT -1"


class StoreError(Exception):
    """The store cannot be used: a damaged or foreign database, a newer schema, no snapshot that verifies, a
    failed write (disk full, I/O error). The message names the file, what failed and the ways on."""


def ways_on(state_dir: Path) -> str:
    """The two ways on from a store the server will not touch, as the refusals say them."""
    return (f"nothing was changed or deleted. Ways on: restore {state_dir} from a copy and start again, or start "
            f"with --fresh, which moves the whole old state aside to {state_dir.parent}/state.broken-<time>/ "
            "(kept) and begins a new federation")


def damaged(db_path: Path, what: str) -> StoreError:
    return StoreError(f"{db_path}: {what}; {ways_on(db_path.parent)}")


@dataclass(frozen=True)
class Snapshot:
    # Rounds completed when the snapshot was taken (0 = the initial state before round 1).
    completed_rounds: int
    # JSON-serializable coordinator state (round machine, clients, history, slots of later state machines...).
    state: dict[str, Any]
    # Model id ("global" today; one per cluster later) -> state dict.
    models: dict[str, dict[str, torch.Tensor]]
    # How many rows of the store's history table the snapshot covers (-1: its history is inside ``state``, as
    # schema-1 stores kept it). On save, :meth:`StateStore.save`'s ``history_tail`` ends at this count.
    history_len: int = -1
    # On save: ``json.dumps(state)`` when the caller has it already (fedserver.persistence reuses the registry's
    # text between rounds), else None.
    state_text: str | None = None


@dataclass(frozen=True)
class SaveStats:
    seconds: float
    model_bytes: int
    state_bytes: int


@dataclass(frozen=True)
class Loaded:
    # The newest snapshot that verified, or None when there is none.
    snapshot: Snapshot | None
    # The latest progress record written on top of that snapshot (see StateStore.put_progress), else None.
    progress: dict[str, Any] | None
    # One line per newer snapshot that failed verification, naming its round and why.
    skipped: list[str] = field(default_factory=list)
    # The history rows the snapshot covers (empty for a schema-1 snapshot, whose history is in its state).
    history: list[dict[str, Any]] = field(default_factory=list)
    # Database ids of the snapshots that failed verification (for :meth:`StateStore.quarantine`).
    skipped_ids: list[int] = field(default_factory=list)


def check_model_id(model_id: str) -> None:
    """Model ids become file names: 1-64 characters of ``[A-Za-z0-9_.-]``."""
    if not isinstance(model_id, str) or not MODEL_ID_RE.fullmatch(model_id):
        raise ValueError(f"model id {model_id!r} is not usable in a file name: use 1-64 characters of "
                         "A-Z a-z 0-9 _ . -")


class StateStore:
    """Snapshots of a federation in ``directory`` (``<run_dir>/state``). Thread-safe; one writer at a time (the
    server holds the run directory's lock, :mod:`fedserver.rundir`)."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3, fsync: bool = False,
                 after_files_written: Callable[[list[Path]], None] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.fsync = fsync
        # Called with a save's model files once they are in place, before the transaction that commits them: the
        # seam where the fault tests kill the process between the two (tests/crash_server.py); None in production.
        self._after_files_written = after_files_written
        self.db_path = self.directory / DB_NAME
        self.models_dir = self.directory / MODELS_DIR
        self._lock = threading.Lock()
        self._history_rows = 0  # rows in the history table (the next save appends after them)
        existed = self.db_path.exists()
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"{self.models_dir}: cannot be created ({e.strerror or e})") from None
        try:
            self._conn = _connect(self.db_path, create=True)
        except sqlite3.Error as e:
            raise damaged(self.db_path, f"cannot be opened as a SQLite database ({e})") from None
        try:
            if existed:
                self._check_integrity()
            self._init_db()
            self.removed_orphans: list[str] = []  # filled by clean_pending()
            self._history_rows = int(self._conn.execute("SELECT count(*) FROM history").fetchone()[0])
            self._has_buffer = self._conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'buffer_updates'").fetchone() is not None
        except sqlite3.Error as e:
            self._conn.close()
            raise damaged(self.db_path, f"not a usable fedguard state store ({e})") from None
        except BaseException:
            self._conn.close()
            raise

    # ---- opening ----

    def _check_integrity(self) -> None:
        """SQLite's ``quick_check`` (every page and index readable and consistent) before anything writes."""
        try:
            rows = self._conn.execute("PRAGMA quick_check(5)").fetchall()
        except sqlite3.Error as e:
            raise damaged(self.db_path, f"cannot be read: {e} (SQLite)") from None
        problems = [line.strip() for r in rows if str(r[0]) != "ok" for line in str(r[0]).splitlines()
                    if line.strip() and not line.startswith("***")]
        if problems:
            more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
            raise damaged(self.db_path, "is damaged: SQLite's integrity check reports " + "; ".join(problems[:3])
                          + more)

    def _init_db(self) -> None:
        c = self._conn
        app_id = int(c.execute("PRAGMA application_id").fetchone()[0])
        version = int(c.execute("PRAGMA user_version").fetchone()[0])
        tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id != APPLICATION_ID and (app_id != 0 or (tables - {"sqlite_sequence"})):
            raise StoreError(f"{self.db_path}: a SQLite database of another program (application_id {app_id}, "
                             f"tables {sorted(tables)}), not a fedguard state store; nothing was changed: move it "
                             "aside or point --run-dir elsewhere")
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.db_path}: schema version {version} was written by a newer fedguard (this one "
                             f"reads up to {SCHEMA_VERSION}); nothing was changed: run that fedguard version")
        mode = str(c.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        if mode != "wal":
            raise StoreError(f"{self.db_path}: cannot switch to WAL journaling (journal_mode is {mode!r})")
        c.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
        if app_id == 0 or version < SCHEMA_VERSION:
            with self._transaction():
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                columns = {r[1] for r in c.execute("PRAGMA table_info(snapshots)")}
                if "history_len" not in columns:
                    c.execute(_MIGRATE_2)
                c.execute(f"PRAGMA application_id={APPLICATION_ID}")
                c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def clean_pending(self) -> list[str]:
        """Remove the files an earlier save recorded in ``pending`` (it wrote them) that no snapshot references:
        the leftovers of a save that crashed before its commit, or of a pruned snapshot whose unlink failed.
        Nothing else is ever removed: a file the store did not write stays, whatever its name. Opening a store
        changes nothing; the server calls this once it carries on from a verified snapshot (and every save
        cleans up after itself)."""
        with self._lock:
            pending = [r[0] for r in self._conn.execute("SELECT path FROM pending")]
            referenced = {r[0] for r in self._conn.execute("SELECT path FROM models")}
        removed: list[str] = []
        for rel in sorted(pending):
            name = store_file(rel)
            if rel in referenced or not name:
                continue
            for candidate in (name, name + TMP_SUFFIX):
                try:
                    (self.models_dir / candidate).unlink()
                    removed.append(f"{MODELS_DIR}/{candidate}")
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise StoreError(f"{self.models_dir / candidate}: cannot remove a leftover of an uncommitted "
                                     f"save ({e.strerror or e})") from None
        if pending:
            with self._lock, self._writing("the pending-files journal"), self._transaction():
                self._conn.executemany("DELETE FROM pending WHERE path = ?", [(p,) for p in pending])
        self.removed_orphans += removed
        return removed

    @staticmethod
    def exists(directory: str | os.PathLike[str]) -> bool:
        """Whether a store with at least one snapshot is in ``directory``. Raises :class:`StoreError` when a
        ``state.db`` is there but cannot be read (it is not an empty place to start over in)."""
        path = Path(directory) / DB_NAME
        if not path.is_file():
            return False
        try:
            conn = _connect(path, create=False)
        except sqlite3.Error as e:
            raise damaged(path, f"cannot be opened ({e})") from None
        try:
            row = conn.execute("SELECT 1 FROM snapshots LIMIT 1").fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return False
            raise damaged(path, f"not a usable fedguard state store ({e})") from None
        except sqlite3.Error as e:
            raise damaged(path, f"not a usable fedguard state store ({e})") from None
        finally:
            conn.close()
        return row is not None

    # ---- meta ----

    def put_meta(self, key: str, value: dict[str, Any]) -> None:
        text = json.dumps(value)
        with self._lock, self._writing(f"the {key!r} record"), self._transaction():
            self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, text))

    def get_meta(self, key: str) -> dict[str, Any] | None:
        with self._lock, self._reading():
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            value = json.loads(row[0])
        except ValueError as e:
            raise damaged(self.db_path, f"meta record {key!r} is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise damaged(self.db_path, f"meta record {key!r} is not a JSON object")
        return value

    # ---- snapshots ----

    def save(self, snap: Snapshot, history_tail: Sequence[dict[str, Any]] = ()) -> SaveStats:
        """Persist a snapshot (blocking file IO: call it from a worker thread in async code).

        ``history_tail`` are the history rows that end at ``snap.history_len`` (the rows the store does not have
        yet; rows it has are replaced only by the same positions of a later save). Raises :class:`StoreError`
        when a write fails (disk full, I/O error): the previous snapshots are then intact."""
        t0 = time.perf_counter()
        if isinstance(snap.completed_rounds, bool) or not isinstance(snap.completed_rounds, int) \
                or snap.completed_rounds < 0:
            raise ValueError(f"completed_rounds must be a non-negative int, got {snap.completed_rounds!r}")
        for model_id in snap.models:
            check_model_id(model_id)
        first_seq = snap.history_len - len(history_tail)
        if history_tail and (snap.history_len < 0 or first_seq < 0):
            raise ValueError(f"history_tail of {len(history_tail)} rows cannot end at history_len "
                             f"{snap.history_len}")
        state_text = snap.state_text if snap.state_text is not None else json.dumps(snap.state)
        tail_texts = [json.dumps(row) for row in history_tail]
        nonce = secrets.token_hex(4)
        names = [f"r{snap.completed_rounds:06d}-{model_id}-{nonce}.fgt" for model_id in sorted(snap.models)]
        with self._lock:
            if snap.history_len >= 0 and first_seq > self._history_rows:
                raise ValueError(f"history rows {self._history_rows}..{first_seq - 1} were never saved")
            written: list[tuple[str, str, str, int]] = []  # model id, relative path, sha256, bytes
            with self._writing(f"the snapshot of round {snap.completed_rounds}"):
                # Write-ahead record of the files this save is about to create: only these may be removed later.
                with self._transaction():
                    self._conn.executemany("INSERT OR IGNORE INTO pending (path) VALUES (?)",
                                           [(f"{MODELS_DIR}/{n}",) for n in names])
                try:
                    for model_id, name in zip(sorted(snap.models), names, strict=True):
                        digest, size = self._write_model(name, snap.models[model_id], model_id,
                                                         snap.completed_rounds)
                        written.append((model_id, f"{MODELS_DIR}/{name}", digest, size))
                    if self.fsync and written:
                        _fsync_dir(self.models_dir)
                    if self._after_files_written is not None:
                        self._after_files_written([self.directory / rel for _, rel, _, _ in written])
                    with self._transaction():
                        dropped = self._commit(snap.completed_rounds, state_text, written, snap.history_len,
                                               first_seq, tail_texts)
                except BaseException:
                    # This process wrote these files and could not commit them: they are its to remove.
                    for _, rel, _, _ in written:
                        with contextlib.suppress(OSError):
                            (self.directory / rel).unlink()
                    raise
            if snap.history_len >= 0:
                self._history_rows = max(self._history_rows, snap.history_len)
            gone: list[str] = []
            for rel in dropped:
                # Superseded by the snapshot just committed; a file that cannot be removed now stays in
                # ``pending`` and is removed by the next clean_pending().
                try:
                    (self.directory / rel).unlink()
                    gone.append(rel)
                except FileNotFoundError:
                    gone.append(rel)
                except OSError:
                    pass
            if gone:
                with contextlib.suppress(sqlite3.Error), self._transaction():
                    self._conn.executemany("DELETE FROM pending WHERE path = ?", [(p,) for p in gone])
        return SaveStats(time.perf_counter() - t0, sum(w[3] for w in written),
                         len(state_text.encode()) + sum(len(t.encode()) for t in tail_texts))

    def _write_model(self, name: str, state: Mapping[str, torch.Tensor], model_id: str,
                     completed_rounds: int) -> tuple[str, int]:
        """Write ``models/<name>`` in save_state's format via a temp name; returns (sha256 hex, bytes)."""
        from fedcore.serialization import _MAGIC, pack

        manifest, payload = pack(state)
        header = json.dumps({
            "tensors": [{"name": m.name, "dtype": m.dtype, "shape": list(m.shape)} for m in manifest],
            "extra": {"store": "fedguard.state", "model_id": model_id, "completed_rounds": completed_rounds},
        }).encode()
        h = hashlib.sha256()
        final = self.models_dir / name
        tmp = final.with_name(name + TMP_SUFFIX)
        size = 0
        try:
            with open(tmp, "wb") as f:
                for part in (_MAGIC, len(header).to_bytes(8, "little"), header, payload):
                    h.update(part)
                    f.write(part)
                    size += len(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        return h.hexdigest(), size

    def _commit(self, completed_rounds: int, state_text: str, written: list[tuple[str, str, str, int]],
                history_len: int, first_seq: int, tail_texts: list[str]) -> list[str]:
        """Inside the save's transaction: insert the snapshot, its models and its history rows, drop the
        snapshots beyond ``keep`` (all older: superseded by this one) and the progress of any older snapshot.
        Returns the dropped snapshots' files (recorded in ``pending`` until they are gone)."""
        c = self._conn
        newer = c.execute("SELECT max(completed_rounds) FROM snapshots WHERE completed_rounds >= ?",
                          (completed_rounds,)).fetchone()[0]
        if newer is not None:
            raise StoreError(f"{self.db_path}: refusing to save round {completed_rounds} over a stored snapshot of "
                             f"round {newer} (another timeline); nothing was changed. Move the newer snapshots "
                             "aside first (fedserver --fall-back quarantines snapshots that fail verification)")
        cur = c.execute("INSERT INTO snapshots (completed_rounds, state, created, history_len) VALUES (?, ?, ?, ?)",
                        (completed_rounds, state_text, time.time(), history_len))
        sid = cur.lastrowid
        assert sid is not None
        c.executemany("INSERT INTO models (snapshot_id, model_id, path, sha256, bytes) VALUES (?, ?, ?, ?, ?)",
                      [(sid, model_id, rel, digest, size) for model_id, rel, digest, size in written])
        c.executemany("INSERT OR REPLACE INTO history (seq, report) VALUES (?, ?)",
                      [(first_seq + i, text) for i, text in enumerate(tail_texts)])
        c.executemany("DELETE FROM pending WHERE path = ?", [(rel,) for _, rel, _, _ in written])
        drop = [r[0] for r in c.execute("SELECT id FROM snapshots WHERE id != ? ORDER BY id DESC LIMIT -1 OFFSET ?",
                                        (sid, self.keep - 1))]
        dropped: list[str] = []
        for old in drop:
            dropped += [r[0] for r in c.execute("SELECT path FROM models WHERE snapshot_id = ?", (old,))]
            c.execute("DELETE FROM models WHERE snapshot_id = ?", (old,))
            c.execute("DELETE FROM snapshots WHERE id = ?", (old,))
        c.execute("DELETE FROM progress WHERE snapshot_id != ?", (sid,))
        if self._has_buffer:  # the buffered updates of the rounds this snapshot completes are in its model now
            c.execute("DELETE FROM buffer_updates WHERE round <= ?", (completed_rounds,))
        # A file is shared by no two rows (nonce per save), but never unlink one that is still referenced.
        live = {r[0] for r in c.execute("SELECT path FROM models")}
        gone = [p for p in dropped if p not in live]
        c.executemany("INSERT OR IGNORE INTO pending (path) VALUES (?)", [(p,) for p in gone])
        return gone

    def put_progress(self, state: dict[str, Any]) -> None:
        """Attach ``state`` to the newest snapshot, replacing the previous record (no model bytes)."""
        text = json.dumps(state)
        with self._lock, self._writing("the round machine's progress record"), self._transaction():
            row = self._conn.execute("SELECT max(id) FROM snapshots").fetchone()
            if row is None or row[0] is None:
                raise StoreError(f"{self.db_path}: no snapshot to attach a progress record to (save one first)")
            self._conn.execute("INSERT OR REPLACE INTO progress (snapshot_id, state, updated) VALUES (?, ?, ?)",
                               (row[0], text, time.time()))

    # ---- buffered rounds: the open buffer's updates ----

    def put_buffered(self, round_: int, attempt: int, client_id: str, base: int, meta: dict[str, Any],
                     tensor: bytes) -> int:
        """Record an update accepted into round ``round_``'s open buffer (one committed transaction: durable against
        a crash of the process, and with ``fsync`` against a power cut); returns its row id (the arrival order)."""
        text = json.dumps(meta)
        with self._lock, self._writing(f"an update of round {round_}'s buffer"), self._transaction():
            if not self._has_buffer:
                self._conn.execute(_BUFFER_TABLE)
            cur = self._conn.execute(
                "INSERT INTO buffer_updates (after_snapshot, round, attempt, client_id, base, meta, tensor) "
                "VALUES ((SELECT coalesce(max(id), 0) FROM snapshots), ?, ?, ?, ?, ?, ?)",
                (round_, attempt, client_id, base, text, tensor))
            self._has_buffer = True
            assert cur.lastrowid is not None
            return int(cur.lastrowid)

    def drop_buffered(self, row_id: int) -> None:
        """Remove the row :meth:`put_buffered` wrote for an update that was not taken after all."""
        with self._lock, self._writing("the buffered updates"), self._transaction():
            self._conn.execute("DELETE FROM buffer_updates WHERE id = ?", (row_id,))

    def buffered(self, round_: int, attempt: int) -> list[tuple[int, str, int, str, bytes]]:
        """The updates recorded after the newest snapshot for round ``round_``'s buffer (attempt ``attempt``), in
        arrival order, as ``(row id, client id, base, meta JSON, tensor bytes)``; the caller decodes them."""
        if not self._has_buffer:
            return []
        with self._lock, self._reading():
            rows = self._conn.execute(
                "SELECT id, client_id, base, meta, tensor FROM buffer_updates WHERE round = ? AND attempt = ? "
                "AND after_snapshot = (SELECT coalesce(max(id), 0) FROM snapshots) ORDER BY id",
                (round_, attempt)).fetchall()
        return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    def load(self, parse: bool = True) -> Loaded:
        """The newest snapshot that verifies, its progress record and history, and a line per newer one that
        did not (their ids in ``skipped_ids``). ``parse=False`` checks the model files' sizes and sha256 only
        and returns no tensors (no torch needed: :func:`check_state`)."""
        skipped: list[str] = []
        skipped_ids: list[int] = []
        with self._lock, self._reading():
            rows = self._conn.execute(
                "SELECT id, completed_rounds, state, history_len FROM snapshots ORDER BY id DESC").fetchall()
            for sid, completed_rounds, state_text, history_len in rows:
                models = self._conn.execute(
                    "SELECT model_id, path, sha256, bytes FROM models WHERE snapshot_id = ? ORDER BY model_id",
                    (sid,)).fetchall()
                try:
                    snap = self._verify(int(completed_rounds), state_text, models, int(history_len), parse)
                    history = self._history(int(history_len))
                except Unverified as e:
                    skipped.append(f"snapshot of round {completed_rounds} skipped: {e}")
                    skipped_ids.append(int(sid))
                    continue
                prow = self._conn.execute("SELECT state FROM progress WHERE snapshot_id = ?", (sid,)).fetchone()
                progress = None
                if prow is not None:
                    try:
                        value = json.loads(prow[0])
                    except (ValueError, RecursionError):
                        value = None
                    if isinstance(value, dict):
                        progress = value
                    else:
                        skipped.append(f"progress record of round {completed_rounds} ignored: not a JSON object")
                return Loaded(snap, progress, skipped, history, skipped_ids)
        return Loaded(None, None, skipped, [], skipped_ids)

    def _history(self, history_len: int) -> list[dict[str, Any]]:
        if history_len < 0:
            return []
        return parse_history(self._conn.execute("SELECT seq, report FROM history WHERE seq < ? ORDER BY seq",
                                                (history_len,)).fetchall(), history_len)

    def _verify(self, completed_rounds: int, state_text: str,
                models: Sequence[tuple[str, str, str, int]], history_len: int = -1, parse: bool = True) -> Snapshot:
        state = parse_state(state_text)
        return Snapshot(completed_rounds, state, verify_models(self.models_dir, models, parse), history_len)

    def quarantine(self, snapshot_ids: Sequence[int], keep_history: int) -> Path | None:
        """Move the snapshots ``snapshot_ids`` (ones that failed verification) and the history rows at and after
        ``keep_history`` (their abandoned timeline) out of the store into ``quarantine/<UTC time>/``: a JSON file
        per snapshot with its rows, beside its model files (those that exist). Nothing is deleted: the rows
        leave the database only after their copy is written. Returns the folder (None when nothing moved)."""
        with self._lock, self._writing("the quarantine of unverified snapshots"):
            ids = sorted(set(int(i) for i in snapshot_ids))
            extra_history = self._conn.execute("SELECT seq, report FROM history WHERE seq >= ? ORDER BY seq",
                                               (keep_history,)).fetchall()
            if not ids and not extra_history:
                return None
            dest = _new_stamped_dir(self.directory / QUARANTINE_DIR)
            moves: list[tuple[Path, Path]] = []
            for sid in ids:
                row = self._conn.execute("SELECT completed_rounds, state, created, history_len FROM snapshots "
                                         "WHERE id = ?", (sid,)).fetchone()
                if row is None:
                    continue
                models = self._conn.execute("SELECT model_id, path, sha256, bytes FROM models WHERE snapshot_id = ?",
                                            (sid,)).fetchall()
                record = {"snapshot_id": sid, "completed_rounds": row[0], "state": row[1], "created": row[2],
                          "history_len": row[3],
                          "models": [{"model_id": m[0], "path": m[1], "sha256": m[2], "bytes": m[3]} for m in models]}
                (dest / f"snapshot-{sid}-r{int(row[0]):06d}.json").write_text(json.dumps(record, indent=1))
                for m in models:
                    name = store_file(m[1])
                    if name and (self.models_dir / name).exists():
                        moves.append((self.models_dir / name, dest / name))
            if extra_history:
                (dest / "history.json").write_text(json.dumps(
                    [{"seq": seq, "report": text} for seq, text in extra_history], indent=1))
            if self.fsync:
                _fsync_dir(dest)
            for src, dst in moves:
                os.rename(src, dst)
            with self._transaction():
                for sid in ids:
                    self._conn.execute("DELETE FROM models WHERE snapshot_id = ?", (sid,))
                    self._conn.execute("DELETE FROM progress WHERE snapshot_id = ?", (sid,))
                    self._conn.execute("DELETE FROM snapshots WHERE id = ?", (sid,))
                self._conn.execute("DELETE FROM history WHERE seq >= ?", (keep_history,))
            self._history_rows = min(self._history_rows, keep_history)
            return dest

    # ---- plumbing ----

    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """A failed write (disk full, I/O error, a damaged page) becomes a :class:`StoreError` naming it."""
        try:
            yield
        except StoreError:
            raise
        except (sqlite3.Error, OSError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            where = getattr(e, "filename", None) or self.db_path
            raise StoreError(f"{where}: cannot write {what}: {reason}. The snapshots already committed are intact: "
                             "fix the cause (free disk space, check the disk) and start the server again; it "
                             "resumes from its last committed round") from None

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            raise damaged(self.db_path, f"cannot be read: {e} (SQLite)") from None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        try:
            self._conn.execute("COMMIT")
        except BaseException:
            # A failed COMMIT (disk full, I/O error) can leave the transaction open: end it, nothing was stored.
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    uri = f"{path.resolve().as_uri()}?mode={'rwc' if create else 'rw'}"
    # Autocommit mode: transactions are explicit (BEGIN IMMEDIATE ... COMMIT).
    return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False, timeout=30.0)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def no_verifiable_snapshot(state_dir: Path, skipped: Sequence[str]) -> StoreError:
    return StoreError(f"{state_dir / DB_NAME}: no snapshot verifies ({'; '.join(skipped)}); {ways_on(state_dir)}")


def newest_unverified(state_dir: Path, skipped: Sequence[str], good_round: int) -> StoreError:
    return StoreError(
        f"{state_dir / DB_NAME}: the newest snapshot does not verify ({'; '.join(skipped)}); nothing was changed or "
        f"deleted. Ways on: start with --fall-back to resume from round {good_round}, the newest snapshot that "
        f"verifies (the unverified ones move to {state_dir}/{QUARANTINE_DIR}/<time>/, kept), or restore {state_dir} "
        f"from a copy, or start with --fresh, which moves the whole old state aside to "
        f"{state_dir.parent}/state.broken-<time>/")


def check_state(state_dir: str | os.PathLike[str], fall_back: bool = False) -> None:
    """Raise the :class:`StoreError` the server would stop with for ``state_dir`` (a damaged or foreign
    ``state.db``, no snapshot that verifies, unverified newest snapshots without ``fall_back``), checking the
    database and the model files' sizes and sha256 without torch, and changing nothing. Nothing to check (no
    ``state.db``) is fine. The server runs the full check (tensors parsed) again when it opens the store."""
    state_dir = Path(state_dir)
    if not (state_dir / DB_NAME).is_file():
        return
    with StateStore(state_dir) as store:
        loaded = store.load(parse=False)
    if loaded.snapshot is None and loaded.skipped:
        raise no_verifiable_snapshot(state_dir, loaded.skipped)
    if loaded.snapshot is not None and loaded.skipped and not fall_back:
        raise newest_unverified(state_dir, loaded.skipped, loaded.snapshot.completed_rounds)


def _new_stamped_dir(parent: Path, prefix: str = "") -> Path:
    """Create ``parent/<prefix><UTC time>`` (``-1``, ``-2``... appended when it exists) and return it."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = prefix + datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    n = 0
    while True:
        dest = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            dest.mkdir()
            return dest
        except FileExistsError:
            n += 1


def archive(run_dir: Path, names: Sequence[str], prefix: str | None = None) -> Path | None:
    """Move the entries of ``run_dir`` named in ``names`` that exist into a new ``run_dir/previous/<UTC time>/``
    (with ``prefix``: ``run_dir/<prefix><UTC time>/``; ``-1``, ``-2``... appended when that exists) and return
    it; None when none of them was there. Nothing is ever deleted."""
    run_dir = Path(run_dir)
    for name in names:
        if not name or name in (".", "..", "previous") or "/" in name or os.sep in name:
            raise ValueError(f"cannot archive {name!r}: give names of entries directly inside the run directory")
    present = [n for n in dict.fromkeys(names) if os.path.lexists(run_dir / n)]
    if not present:
        return None
    dest = _new_stamped_dir(run_dir / "previous") if prefix is None else _new_stamped_dir(run_dir, prefix)
    for name in present:
        os.rename(run_dir / name, dest / name)
    return dest
