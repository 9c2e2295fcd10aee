"""The coordinator's snapshot store: round trips, pruning, verification and fallback, crash leftovers, archive."""

from __future__ import annotations

import math
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedcore.serialization import load_state, save_state
from fedserver.store import Loaded, Snapshot, StateStore, StoreError, archive

ROOT = Path(__file__).resolve().parents[2]


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fc.weight": torch.randn(8, 5, generator=g),
        "fc.bias": torch.randn(8, generator=g).to(torch.float64),
        "bn.num_batches_tracked": torch.tensor(seed, dtype=torch.int64),
        "half": torch.randn(3, generator=g).to(torch.bfloat16),
        "mask": torch.randint(0, 2, (4, 2), generator=g).bool(),
        "codes": torch.randint(-128, 127, (6,), generator=g, dtype=torch.int8),
        "empty": torch.zeros(0, 3),
    }


def _state(r: int) -> dict[str, object]:
    return {"round_state": {"round": r + 1, "attempt": 0, "phase_since": 0.1 + r / 3,
                            "clients": {f"c{i}": {"index": i, "alive": i % 2 == 0} for i in range(3)}},
            "history": [{"round": k, "beta": 1 / 3 + k, "note": "ünïcode"} for k in range(1, r + 1)],
            "slots": {"nfl": {"x": [1, 2.5, None, True]}}}


def _snap(r: int, ids: tuple[str, ...] = ("global",)) -> Snapshot:
    return Snapshot(r, _state(r), {mid: _model(r * 10 + i) for i, mid in enumerate(ids)})


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d / "models"))


def _path_of(d: Path, r: int, model_id: str = "global") -> Path:
    (name,) = [f for f in _files(d) if f.startswith(f"r{r:06d}-{model_id}-")]
    return d / "models" / name


def test_empty_dir_loads_nothing(tmp_path: Path) -> None:
    d = tmp_path / "state"
    assert not StateStore.exists(d)
    with StateStore(d) as s:
        assert s.load() == Loaded(None, None, [])
    assert (d / "state.db").is_file() and (d / "models").is_dir()
    assert not StateStore.exists(d)


def test_round_trip_is_bit_identical(tmp_path: Path) -> None:
    d = tmp_path / "state"
    snap = _snap(4, ("global", "cluster-0", "c_1.x"))
    snap.state["nan"] = math.nan
    with StateStore(d) as s:
        stats = s.save(snap)
        assert stats.model_bytes == sum(p.stat().st_size for p in (d / "models").iterdir())
        assert stats.state_bytes > 100 and stats.seconds > 0
    assert StateStore.exists(d)
    with StateStore(d) as s:
        loaded = s.load()
    assert loaded.skipped == [] and loaded.progress is None and loaded.snapshot is not None
    got = loaded.snapshot
    assert got.completed_rounds == 4
    nan = got.state.pop("nan")
    assert math.isnan(nan)
    snap.state.pop("nan")
    assert got.state == snap.state
    assert sorted(got.models) == sorted(snap.models)
    for mid in snap.models:
        _same(snap.models[mid], got.models[mid])


def test_model_file_is_save_state_format(tmp_path: Path) -> None:
    d = tmp_path / "state"
    with StateStore(d) as s:
        s.save(_snap(2))
    path = _path_of(d, 2)
    tensors, extra = load_state(path)
    _same(tensors, _model(20))
    assert extra["model_id"] == "global" and extra["completed_rounds"] == 2
    ref = tmp_path / "ref.fgt"
    save_state(ref, _model(20), extra)
    assert ref.read_bytes() == path.read_bytes()


def test_keep_prunes_rows_and_files(tmp_path: Path) -> None:
    d = tmp_path / "state"
    with StateStore(d, keep=2) as s:
        for r in range(5):
            s.save(_snap(r, ("global", "k1")))
        rounds = [int(row[0]) for row in s._conn.execute("SELECT completed_rounds FROM snapshots ORDER BY id")]
        nmodels = s._conn.execute("SELECT count(*) FROM models").fetchone()[0]
    assert rounds == [3, 4]
    assert nmodels == 4
    assert [f[:7] for f in _files(d)] == ["r000003", "r000003", "r000004", "r000004"]


def _three(d: Path) -> None:
    with StateStore(d, keep=5) as s:
        for r in (1, 2, 3):
            s.save(_snap(r, ("global", "other")))


@pytest.mark.parametrize(("damage", "reason"), [
    ("truncate", "truncated or half-written"),
    ("flip", "fails its sha256 checksum: corrupt or half-written"),
    ("missing", "is missing"),
])
def test_damaged_newest_falls_back(tmp_path: Path, damage: str, reason: str) -> None:
    d = tmp_path / "state"
    _three(d)
    path = _path_of(d, 3, "other")
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 0x01]) + data[-4:])
    else:
        path.unlink()
    with StateStore(d) as s:
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 2
    _same(loaded.snapshot.models["other"], _model(21))
    assert len(loaded.skipped) == 1
    line = loaded.skipped[0]
    assert line.startswith("snapshot of round 3 skipped: model 'other' (models/r000003-other-"), line
    assert reason in line


def test_all_damaged_loads_nothing_and_lists_each(tmp_path: Path) -> None:
    d = tmp_path / "state"
    _three(d)
    for r in (1, 2, 3):
        _path_of(d, r).unlink()
    with StateStore(d) as s:
        loaded = s.load()
    assert loaded.snapshot is None and loaded.progress is None
    assert [line.split(":")[0] for line in loaded.skipped] == [f"snapshot of round {r} skipped" for r in (3, 2, 1)]


def test_bad_state_json_counts_as_failed(tmp_path: Path) -> None:
    d = tmp_path / "state"
    _three(d)
    with StateStore(d) as s:
        s._conn.execute("UPDATE snapshots SET state = '{\"round_state\": ' WHERE completed_rounds = 3")
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 2
    assert loaded.skipped and "round 3" in loaded.skipped[0] and "not valid JSON" in loaded.skipped[0]


def test_path_outside_models_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    _three(d)
    save_state(tmp_path / "evil.fgt", _model(0))
    with StateStore(d) as s:
        s._conn.execute("UPDATE models SET path = '../evil.fgt' WHERE snapshot_id = 3 AND model_id = 'global'")
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 2
    assert "not a path inside" in loaded.skipped[0]


def test_files_the_store_did_not_record_writing_are_never_removed(tmp_path: Path) -> None:
    d = tmp_path / "state"
    _three(d)
    models = d / "models"
    # Named like the store's own files, but no save recorded writing them: they stay (never destroy state).
    lookalike = models / "r000004-global-0123abcd.fgt"
    save_state(lookalike, _model(4))
    tmp_lookalike = models / "r000004-other-0123abcd.fgt.tmp"
    tmp_lookalike.write_bytes(b"half")
    foreign = [models / "notes.txt", models / "r4-global.fgt", models / "r000004-global-XYZ.fgt"]
    for f in foreign:
        f.write_bytes(b"not ours")
    with StateStore(d) as s:
        assert s.clean_pending() == []
        loaded = s.load()
    assert lookalike.exists() and tmp_lookalike.exists()
    assert all(f.exists() for f in foreign)
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 3 and loaded.skipped == []
    assert len([f for f in _files(d) if re.fullmatch(r"r00000[123]-\w+-[0-9a-f]{8}\.fgt", f)]) == 6


def test_pending_leftovers_of_an_uncommitted_save_are_removed_on_open(tmp_path: Path) -> None:
    d = tmp_path / "state"
    _three(d)
    with StateStore(d) as s:  # a save that recorded its files, wrote them and died before its commit
        s._conn.execute("INSERT INTO pending (path) VALUES ('models/r000004-global-0123abcd.fgt')")
    leftover = d / "models" / "r000004-global-0123abcd.fgt"
    save_state(leftover, _model(4))
    leftover.with_name(leftover.name + ".tmp").write_bytes(b"half")
    with StateStore(d) as s:
        assert s.removed_orphans == []  # opening changes nothing
        assert sorted(s.clean_pending()) == ["models/r000004-global-0123abcd.fgt",
                                             "models/r000004-global-0123abcd.fgt.tmp"]
        assert s._conn.execute("SELECT count(*) FROM pending").fetchone()[0] == 0
        assert s.load().snapshot.completed_rounds == 3  # type: ignore[union-attr]
    assert not leftover.exists()


def _run_child(d: Path, body: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent("""
        import os, signal, sys, torch
        from fedserver import store
        from fedserver.store import Snapshot, StateStore
        d = sys.argv[1]
        def model(seed):
            return {"w": torch.full((4, 4), float(seed)), "n": torch.tensor(seed)}
    """) + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code, str(d)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_sigkill_between_files_and_commit(tmp_path: Path) -> None:
    d = tmp_path / "state"
    res = _run_child(d, """
        s = StateStore(d)
        s.save(Snapshot(1, {"r": 1}, {"global": model(1), "b": model(2)}))
        s.close()
        s = StateStore(d, after_files_written=lambda paths: os.kill(os.getpid(), signal.SIGKILL))
        s.save(Snapshot(2, {"r": 2}, {"global": model(3), "b": model(4)}))
        print("not reached")
    """)
    assert res.returncode == -9, res.stderr
    assert "not reached" not in res.stdout
    left = _files(d)
    assert len([f for f in left if f.startswith("r000002-")]) == 2  # the uncommitted save's files
    with StateStore(d) as s:
        assert len(s.clean_pending()) == 2  # recorded in ``pending`` before they were written
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 1 and loaded.skipped == []
    assert loaded.snapshot.state == {"r": 1}
    assert torch.equal(loaded.snapshot.models["global"]["w"], torch.full((4, 4), 1.0))
    assert [f[:7] for f in _files(d)] == ["r000001", "r000001"]


def test_sigkill_during_saves_resumes_from_a_reported_round(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    code = """
        s = StateStore(d, keep=2)
        for r in range(1, 10**6):
            s.save(Snapshot(r, {"r": r}, {"global": model(r)}))
            s.put_progress({"after": r})
            print(r, flush=True)
    """
    body = textwrap.dedent("""
        import os, signal, sys, torch
        from fedserver.store import Snapshot, StateStore
        d = sys.argv[1]
        def model(seed):
            return {"w": torch.full((64, 64), float(seed)), "n": torch.tensor(seed)}
    """) + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", body, str(d)], env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    last = 0
    for line in proc.stdout:
        last = int(line)
        if last >= 40:
            break
    proc.kill()
    proc.wait()
    with StateStore(d) as s:
        loaded = s.load()
    assert loaded.skipped == []
    snap = loaded.snapshot
    assert snap is not None and snap.completed_rounds >= last
    assert snap.state == {"r": snap.completed_rounds}
    assert torch.equal(snap.models["global"]["w"], torch.full((64, 64), float(snap.completed_rounds)))
    assert loaded.progress in (None, {"after": snap.completed_rounds})


def test_progress_attaches_to_newest_and_not_after_fallback(tmp_path: Path) -> None:
    d = tmp_path / "state"
    with StateStore(d) as s:
        with pytest.raises(StoreError, match="no snapshot"):
            s.put_progress({"x": 0})
        s.save(_snap(1))
        s.put_progress({"round_state": {"round": 2, "attempt": 1}})
        s.put_progress({"round_state": {"round": 2, "attempt": 2}})
        assert s.load().progress == {"round_state": {"round": 2, "attempt": 2}}
        s.save(_snap(2))
        assert s.load().progress is None  # a new snapshot starts without progress
        s.put_progress({"round_state": {"round": 3, "attempt": 5}})
        assert s.load().progress == {"round_state": {"round": 3, "attempt": 5}}
    _path_of(d, 2).write_bytes(b"garbage")
    with StateStore(d) as s:
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 1
    assert loaded.progress is None
    assert "round 2" in loaded.skipped[0]


def test_a_save_over_a_newer_timeline_is_refused_and_quarantine_moves_it_aside(tmp_path: Path) -> None:
    d = tmp_path / "state"
    _three(d)
    lost = _path_of(d, 3)
    lost_bytes = lost.read_bytes()
    lost.write_bytes(lost_bytes[:100])  # truncated
    with StateStore(d, keep=5) as s:
        loaded = s.load()
        assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 2
        with pytest.raises(StoreError, match="refusing to save round 3 over a stored snapshot of round 3"):
            s.save(_snap(3))
        dest = s.quarantine(loaded.skipped_ids, keep_history=0)
        assert dest is not None and dest.parent == d / "quarantine"
        s.save(_snap(3))  # round 3 re-run on the timeline of round 2
        rounds = [int(r[0]) for r in s._conn.execute("SELECT completed_rounds FROM snapshots ORDER BY id")]
        again = s.load()
    assert rounds == [1, 2, 3]
    assert again.skipped == [] and again.snapshot is not None and again.snapshot.completed_rounds == 3
    # The unverified snapshot is kept: its rows as JSON, its (truncated) file moved beside them.
    (record,) = dest.glob("snapshot-*-r000003.json")
    assert "models/r000003-global-" in record.read_text()
    assert (dest / lost.name).read_bytes() == lost_bytes[:100]


def test_history_is_appended_and_covered_by_each_snapshot(tmp_path: Path) -> None:
    d = tmp_path / "state"
    rows = [{"round": k, "beta": k / 3} for k in range(1, 6)]
    with StateStore(d, keep=2) as s:
        for r in range(1, 6):
            s.save(Snapshot(r, {"r": r}, {"global": _model(r)}, history_len=r), rows[r - 1:r])
        with pytest.raises(ValueError, match="never saved"):
            s.save(Snapshot(7, {"r": 7}, {"global": _model(7)}, history_len=7), rows[:1])
    with StateStore(d) as s:
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.history_len == 5 and loaded.history == rows
    with StateStore(d) as s:
        s._conn.execute("DELETE FROM history WHERE seq = 4")
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 4 and loaded.history == rows[:4]
    assert "its history has 4 of the 5 rows" in loaded.skipped[0]


def test_garbage_db_is_a_store_error(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    (d / "state.db").write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(StoreError, match=re.escape(str(d / "state.db"))) as e:
        StateStore(d)
    assert "file is not a database" in str(e.value) and "--fresh" in str(e.value)
    with pytest.raises(StoreError):
        StateStore.exists(d)


def test_foreign_sqlite_db_is_a_store_error(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir()
    conn = sqlite3.connect(d / "state.db")
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="another program"):
        StateStore(d)


def test_wal_and_synchronous(tmp_path: Path) -> None:
    with StateStore(tmp_path / "a") as s:
        assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    with StateStore(tmp_path / "b", fsync=True) as s:
        assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        s.save(_snap(1))
        assert s.load().snapshot is not None
    conn = sqlite3.connect(tmp_path / "a" / "state.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent in the file
    conn.close()


def test_meta(tmp_path: Path) -> None:
    d = tmp_path / "state"
    with StateStore(d) as s:
        assert s.get_meta("config") is None
        s.put_meta("config", {"model": {"name": "mlp"}, "rounds": 3})
        s.put_meta("config", {"model": {"name": "mlp"}, "rounds": 4})
    with StateStore(d) as s:
        assert s.get_meta("config") == {"model": {"name": "mlp"}, "rounds": 4}


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "a b", "x" * 65, "é"])
def test_bad_model_ids_are_refused_before_writing(tmp_path: Path, bad: str) -> None:
    d = tmp_path / "state"
    with StateStore(d) as s:
        with pytest.raises(ValueError, match="model id"):
            s.save(Snapshot(1, {}, {"global": _model(0), bad: _model(1)}))
        assert _files(d) == []
        assert s.load() == Loaded(None, None, [])


def test_failed_save_leaves_nothing(tmp_path: Path) -> None:
    d = tmp_path / "state"
    with StateStore(d) as s:
        s.save(_snap(1))
        bad = {"global": _model(0), "z": {"c": torch.zeros(2, dtype=torch.complex64)}}
        with pytest.raises(ValueError, match="not supported"):
            s.save(Snapshot(2, {}, bad))
        assert [f[:7] for f in _files(d)] == ["r000001"]
        loaded = s.load()
    assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == 1


def test_files_written_hook_sees_the_save_before_its_commit(tmp_path: Path) -> None:
    d = tmp_path / "state"
    seen: list[list[str]] = []

    def hook(paths: list[Path]) -> None:
        seen.append(sorted(p.name for p in paths))
        assert all(p.exists() for p in paths)
        conn = sqlite3.connect(d / "state.db")
        try:  # the files are in place, the snapshot is not committed yet
            assert conn.execute("SELECT count(*) FROM snapshots").fetchone()[0] == 0
        finally:
            conn.close()

    with StateStore(d, after_files_written=hook) as s:
        s.save(_snap(1))
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].startswith("r000001-global-")
    with StateStore(d) as s:  # off by default
        assert s._after_files_written is None
        s.save(_snap(2))
    assert len(seen) == 1


def test_archive_moves_and_never_deletes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert archive(run, ["state"]) is None  # no run dir at all
    run.mkdir()
    assert archive(run, ["state", "rounds.jsonl"]) is None
    assert not (run / "previous").exists()
    with StateStore(run / "state") as s:
        s.save(_snap(1))
    (run / "rounds.jsonl").write_text('{"round": 1}\n')
    (run / "keep.txt").write_text("untouched")
    first = archive(run, ["state", "rounds.jsonl", "config.json", "final_model.fgt"])
    assert first is not None and first.parent == run / "previous"
    assert re.fullmatch(r"\d{8}T\d{6}Z", first.name)
    assert sorted(os.listdir(first)) == ["rounds.jsonl", "state"]
    assert (first / "rounds.jsonl").read_text() == '{"round": 1}\n'
    assert not (run / "state").exists() and not (run / "rounds.jsonl").exists()
    assert (run / "keep.txt").read_text() == "untouched"
    with StateStore(first / "state") as s:
        assert s.load().snapshot is not None
    # Same second: a second folder, the first is left alone.
    (run / "rounds.jsonl").write_text("again\n")
    second = archive(run, ["rounds.jsonl"])
    assert second is not None and second != first
    assert (second / "rounds.jsonl").read_text() == "again\n"
    assert sorted(os.listdir(first)) == ["rounds.jsonl", "state"]
    with pytest.raises(ValueError):
        archive(run, ["../x"])


def test_unopenable_db_is_a_store_error(tmp_path: Path) -> None:
    d = tmp_path / "state"
    (d / "state.db").mkdir(parents=True)
    with pytest.raises(StoreError, match="cannot be opened"):
        StateStore(d)
