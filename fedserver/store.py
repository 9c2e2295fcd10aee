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
snapshot); those orphans are deleted on the next open.

:meth:`StateStore.load` returns the newest snapshot whose every model file exists, has the recorded size and
sha256 and parses; a newer snapshot that fails (a file half-written before a power cut without ``fsync``, a
disk error, a hand-edited file) is reported in :attr:`Loaded.skipped` and the next older one is tried.

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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from fedcore.serialization import _MAGIC, SerializationError, load_state, pack

DB_NAME = "state.db"
MODELS_DIR = "models"
# PRAGMA application_id of a fedguard state store ("FGST"), and the schema version in PRAGMA user_version.
APPLICATION_ID = 0x46475354
SCHEMA_VERSION = 1
MODEL_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# The store's own files inside models/ (final names and their temp names); nothing else there is touched.
_FILE_RE = re.compile(r"r(\d{6,})-([A-Za-z0-9_.-]{1,64})-([0-9a-f]{8})\.fgt(\.tmp)?")
_TMP_SUFFIX = ".tmp"

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
"""

# Test hook: called after a save's model files are in place and before its transaction (a crash there).
_after_files_written: Callable[[list[Path]], None] | None = None


class StoreError(Exception):
    """The store cannot be used at all (not a SQLite database, a newer schema, another program's database)."""


@dataclass(frozen=True)
class Snapshot:
    # Rounds completed when the snapshot was taken (0 = the initial state before round 1).
    completed_rounds: int
    # JSON-serializable coordinator state (round machine, clients, history, slots of later state machines...).
    state: dict[str, Any]
    # Model id ("global" today; one per cluster later) -> state dict.
    models: dict[str, dict[str, torch.Tensor]]


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


def check_model_id(model_id: str) -> None:
    """Model ids become file names: 1-64 characters of ``[A-Za-z0-9_.-]``."""
    if not isinstance(model_id, str) or not MODEL_ID_RE.fullmatch(model_id):
        raise ValueError(f"model id {model_id!r} is not usable in a file name: use 1-64 characters of "
                         "A-Z a-z 0-9 _ . -")


class StateStore:
    """Snapshots of a federation in ``directory`` (``<run_dir>/state``). Thread-safe; one writer at a time."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 3, fsync: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.fsync = fsync
        self.db_path = self.directory / DB_NAME
        self.models_dir = self.directory / MODELS_DIR
        self._lock = threading.Lock()
        self.models_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = _connect(self.db_path, create=True)
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{self.db_path}: cannot be opened as a SQLite database ({e})") from None
        try:
            self._init_db()
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise StoreError(f"{self.db_path}: not a usable fedguard state store ({e}); move it aside, or start "
                             "over with --fresh (which moves the old state aside)") from None
        except StoreError:
            self._conn.close()
            raise
        self.removed_orphans = self._remove_orphans()

    # ---- opening ----

    def _init_db(self) -> None:
        c = self._conn
        app_id = int(c.execute("PRAGMA application_id").fetchone()[0])
        version = int(c.execute("PRAGMA user_version").fetchone()[0])
        tables = {r[0] for r in c.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if app_id != APPLICATION_ID and (app_id != 0 or (tables - {"sqlite_sequence"})):
            raise StoreError(f"{self.db_path}: a SQLite database of another program (application_id {app_id}, "
                             f"tables {sorted(tables)}), not a fedguard state store; move it aside")
        if version > SCHEMA_VERSION:
            raise StoreError(f"{self.db_path}: schema version {version} was written by a newer fedguard (this one "
                             f"reads up to {SCHEMA_VERSION})")
        mode = str(c.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        if mode != "wal":
            raise StoreError(f"{self.db_path}: cannot switch to WAL journaling (journal_mode is {mode!r})")
        c.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
        if app_id == 0 or version < SCHEMA_VERSION:
            with self._transaction():
                for stmt in _SCHEMA.split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                c.execute(f"PRAGMA application_id={APPLICATION_ID}")
                c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _remove_orphans(self) -> list[str]:
        """Delete the store's own files in models/ that no snapshot references (crash leftovers)."""
        with self._lock:
            referenced = {r[0] for r in self._conn.execute("SELECT path FROM models")}
        removed: list[str] = []
        for entry in sorted(os.listdir(self.models_dir)):
            rel = f"{MODELS_DIR}/{entry}"
            if _FILE_RE.fullmatch(entry) and rel not in referenced:
                with contextlib.suppress(FileNotFoundError):
                    (self.models_dir / entry).unlink()
                    removed.append(rel)
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
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{path}: cannot be opened ({e})") from None
        try:
            row = conn.execute("SELECT 1 FROM snapshots LIMIT 1").fetchone()
        except sqlite3.OperationalError as e:
            if "no such table" in str(e):
                return False
            raise StoreError(f"{path}: not a usable fedguard state store ({e})") from None
        except sqlite3.DatabaseError as e:
            raise StoreError(f"{path}: not a usable fedguard state store ({e})") from None
        finally:
            conn.close()
        return row is not None

    # ---- meta ----

    def put_meta(self, key: str, value: dict[str, Any]) -> None:
        text = json.dumps(value)
        with self._lock, self._transaction():
            self._conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, text))

    def get_meta(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        try:
            value = json.loads(row[0])
        except ValueError as e:
            raise StoreError(f"{self.db_path}: meta record {key!r} is not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise StoreError(f"{self.db_path}: meta record {key!r} is not a JSON object")
        return value

    # ---- snapshots ----

    def save(self, snap: Snapshot) -> SaveStats:
        """Persist a snapshot (blocking file IO: call it from a worker thread in async code)."""
        t0 = time.perf_counter()
        if isinstance(snap.completed_rounds, bool) or not isinstance(snap.completed_rounds, int) \
                or snap.completed_rounds < 0:
            raise ValueError(f"completed_rounds must be a non-negative int, got {snap.completed_rounds!r}")
        for model_id in snap.models:
            check_model_id(model_id)
        state_text = json.dumps(snap.state)
        nonce = secrets.token_hex(4)
        with self._lock:
            written: list[tuple[str, str, str, int]] = []  # model id, relative path, sha256, bytes
            try:
                for model_id in sorted(snap.models):
                    name = f"r{snap.completed_rounds:06d}-{model_id}-{nonce}.fgt"
                    digest, size = self._write_model(name, snap.models[model_id], model_id, snap.completed_rounds)
                    written.append((model_id, f"{MODELS_DIR}/{name}", digest, size))
                if self.fsync and written:
                    _fsync_dir(self.models_dir)
                if _after_files_written is not None:
                    _after_files_written([self.directory / rel for _, rel, _, _ in written])
                with self._transaction():
                    dropped = self._commit(snap.completed_rounds, state_text, written)
            except BaseException:
                for _, rel, _, _ in written:
                    with contextlib.suppress(OSError):
                        (self.directory / rel).unlink()
                raise
            for rel in dropped:
                # Committed already: a file that cannot be removed now is an orphan, removed on the next open.
                with contextlib.suppress(OSError):
                    (self.directory / rel).unlink()
        return SaveStats(time.perf_counter() - t0, sum(w[3] for w in written), len(state_text.encode()))

    def _write_model(self, name: str, state: Mapping[str, torch.Tensor], model_id: str,
                     completed_rounds: int) -> tuple[str, int]:
        """Write ``models/<name>`` in save_state's format via a temp name; returns (sha256 hex, bytes)."""
        manifest, payload = pack(state)
        header = json.dumps({
            "tensors": [{"name": m.name, "dtype": m.dtype, "shape": list(m.shape)} for m in manifest],
            "extra": {"store": "fedguard.state", "model_id": model_id, "completed_rounds": completed_rounds},
        }).encode()
        h = hashlib.sha256()
        final = self.models_dir / name
        tmp = final.with_name(name + _TMP_SUFFIX)
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

    def _commit(self, completed_rounds: int, state_text: str,
                written: list[tuple[str, str, str, int]]) -> list[str]:
        """Inside the save's transaction: insert the snapshot and its models, drop what it supersedes and what
        is beyond ``keep``, and the progress of any older snapshot. Returns the dropped snapshots' files."""
        c = self._conn
        # Snapshots of this round or later belong to a timeline the coordinator abandoned (it resumed from an
        # earlier one, e.g. after they failed verification): this one supersedes them.
        stale = [r[0] for r in c.execute("SELECT id FROM snapshots WHERE completed_rounds >= ?",
                                         (completed_rounds,))]
        cur = c.execute("INSERT INTO snapshots (completed_rounds, state, created) VALUES (?, ?, ?)",
                        (completed_rounds, state_text, time.time()))
        sid = cur.lastrowid
        assert sid is not None
        c.executemany("INSERT INTO models (snapshot_id, model_id, path, sha256, bytes) VALUES (?, ?, ?, ?, ?)",
                      [(sid, model_id, rel, digest, size) for model_id, rel, digest, size in written])
        beyond = [r[0] for r in c.execute("SELECT id FROM snapshots WHERE id != ? ORDER BY id DESC LIMIT -1 OFFSET ?",
                                          (sid, self.keep - 1))]
        drop = sorted(set(stale) | set(beyond))
        dropped: list[str] = []
        for old in drop:
            dropped += [r[0] for r in c.execute("SELECT path FROM models WHERE snapshot_id = ?", (old,))]
            c.execute("DELETE FROM models WHERE snapshot_id = ?", (old,))
            c.execute("DELETE FROM snapshots WHERE id = ?", (old,))
        c.execute("DELETE FROM progress WHERE snapshot_id != ?", (sid,))
        # A file is shared by no two rows (nonce per save), but never unlink one that is still referenced.
        live = {r[0] for r in c.execute("SELECT path FROM models")}
        return [p for p in dropped if p not in live]

    def put_progress(self, state: dict[str, Any]) -> None:
        """Attach ``state`` to the newest snapshot, replacing the previous record (no model bytes)."""
        text = json.dumps(state)
        with self._lock, self._transaction():
            row = self._conn.execute("SELECT max(id) FROM snapshots").fetchone()
            if row is None or row[0] is None:
                raise StoreError(f"{self.db_path}: no snapshot to attach a progress record to (save one first)")
            self._conn.execute("INSERT OR REPLACE INTO progress (snapshot_id, state, updated) VALUES (?, ?, ?)",
                               (row[0], text, time.time()))

    def load(self) -> Loaded:
        """The newest snapshot that verifies, its progress record, and a line per newer one that did not."""
        skipped: list[str] = []
        with self._lock:
            rows = self._conn.execute("SELECT id, completed_rounds, state FROM snapshots ORDER BY id DESC").fetchall()
            for sid, completed_rounds, state_text in rows:
                models = self._conn.execute(
                    "SELECT model_id, path, sha256, bytes FROM models WHERE snapshot_id = ? ORDER BY model_id",
                    (sid,)).fetchall()
                try:
                    snap = self._verify(int(completed_rounds), state_text, models)
                except _Unverified as e:
                    skipped.append(f"snapshot of round {completed_rounds} skipped: {e}")
                    continue
                prow = self._conn.execute("SELECT state FROM progress WHERE snapshot_id = ?", (sid,)).fetchone()
                progress = None
                if prow is not None:
                    try:
                        value = json.loads(prow[0])
                    except ValueError:
                        value = None
                    if isinstance(value, dict):
                        progress = value
                    else:
                        skipped.append(f"progress record of round {completed_rounds} ignored: not a JSON object")
                return Loaded(snap, progress, skipped)
        return Loaded(None, None, skipped)

    def _verify(self, completed_rounds: int, state_text: str,
                models: Sequence[tuple[str, str, str, int]]) -> Snapshot:
        try:
            state = json.loads(state_text)
        except (ValueError, TypeError) as e:
            raise _Unverified(f"its state record is not valid JSON ({e})") from None
        if not isinstance(state, dict):
            raise _Unverified(f"its state record is a JSON {type(state).__name__}, not an object")
        out: dict[str, dict[str, torch.Tensor]] = {}
        for model_id, rel, digest, size in models:
            what = f"model {model_id!r} ({rel})"
            name = rel[len(MODELS_DIR) + 1:] if rel.startswith(MODELS_DIR + "/") else ""
            if not _FILE_RE.fullmatch(name) or name.endswith(_TMP_SUFFIX):
                raise _Unverified(f"{what} is not a path inside the store's {MODELS_DIR}/ folder")
            path = self.models_dir / name
            try:
                with open(path, "rb") as f:
                    got_size = os.fstat(f.fileno()).st_size
                    if got_size != size:
                        raise _Unverified(f"{what} has {got_size} bytes, {size} were written: truncated or "
                                          "half-written")
                    h = hashlib.sha256()
                    while block := f.read(1 << 20):
                        h.update(block)
                    got = h.hexdigest()
            except FileNotFoundError:
                raise _Unverified(f"{what} is missing") from None
            except OSError as e:
                raise _Unverified(f"{what} cannot be read ({e.strerror or e})") from None
            if got != digest:
                raise _Unverified(f"{what} fails its sha256 checksum: corrupt or half-written")
            try:
                tensors, extra = load_state(path)
            except (SerializationError, ValueError, OSError) as e:
                raise _Unverified(f"{what} cannot be parsed ({e})") from None
            if extra.get("model_id", model_id) != model_id:
                raise _Unverified(f"{what} holds model {extra.get('model_id')!r}")
            out[model_id] = tensors
        return Snapshot(completed_rounds, state, out)

    # ---- plumbing ----

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


class _Unverified(Exception):
    """Why a snapshot failed verification (becomes a line of :attr:`Loaded.skipped`)."""


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


def archive(run_dir: Path, names: Sequence[str]) -> Path | None:
    """Move the entries of ``run_dir`` named in ``names`` that exist into a new ``run_dir/previous/<UTC time>/``
    (``-1``, ``-2``... appended when that exists) and return it; None when none of them was there. Nothing is
    ever deleted."""
    run_dir = Path(run_dir)
    for name in names:
        if not name or name in (".", "..", "previous") or "/" in name or os.sep in name:
            raise ValueError(f"cannot archive {name!r}: give names of entries directly inside the run directory")
    present = [n for n in dict.fromkeys(names) if os.path.lexists(run_dir / n)]
    if not present:
        return None
    parent = run_dir / "previous"
    parent.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    n = 0
    while True:
        dest = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            dest.mkdir()
            break
        except FileExistsError:
            n += 1
    for name in present:
        os.rename(run_dir / name, dest / name)
    return dest
