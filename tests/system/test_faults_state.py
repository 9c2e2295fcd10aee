"""Real processes: the state store never destroys a run (issue 25, items 1-2).

A module fixture runs one small federation (``python -m fedserver`` + two ``python -m fedclient`` processes, three
rounds); every test copies its run directory, damages the copy the way the case says, starts ``fedserver`` on it
and asserts the outcome (exit code, the one message and the time to it) and that the old state is intact: the
run directory is compared byte for byte before and after (``server.lock``, the server's own lock file, aside).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedlaunch.supervise import free_server_port
from fedserver.store import StateStore

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
ROUNDS, K = 3, 2
FEDERATION = ["--rounds", str(ROUNDS), "-k", str(K), "--min-available", str(K), "--model", "mlp", "--dataset",
              "synthetic", "--insecure", "--linger", "0.5"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _port() -> int:
    return free_server_port()  # P + 1 free too: the server's "auto" framed port


def _server(run_dir: Path, port: int, *extra: str, log: Path | None = None) -> subprocess.Popen[str]:
    """``fedserver`` with JSON log lines on stderr: into ``log`` when given, else a pipe."""
    err = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "fedserver", "--run-dir", str(run_dir), "--address",
                             f"127.0.0.1:{port}", "--log-json", *FEDERATION, *extra],
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=err, text=True)


def _clients(port: int, tmp: Path) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, "-m", "fedclient", "--server", f"127.0.0.1:{port}", "--insecure",
                              "--client-id", f"c{i}", "--data-index", str(i), "--state-dir", str(tmp / f"c{i}"),
                              "--torch-threads", "1", "--give-up-after", "30", "--log-level", "warning"],
                             cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
            for i in range(K)]


def _stop(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*"))
            if f.is_file() and f.name != "server.lock"}


def _refused(run_dir: Path, *extra: str, timeout: float = 60) -> tuple[int, str, float]:
    """Start fedserver on ``run_dir``; (exit code, stderr, seconds to exit)."""
    t0 = time.monotonic()
    p = _server(run_dir, _port(), *extra)
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err, time.monotonic() - t0


def _record(case: str, rc: int | None, seconds: float, line: str) -> None:
    """One row for docs/results/reliability.md (``pytest -s tests/system/test_faults_state.py | grep FAULT``)."""
    print(f"\nFAULT | {case} | exit {rc} | {seconds:.2f} s | {line[:160]}")


# gRPC's own report of a call it cancelled while the server stopped (printed by grpcio, not by fedguard).
_GRPC_CANCELLED = ("Traceback (most recent call last):",
                   'File "src/python/grpcio/grpc/_cython/_cygrpc/aio/server.pyx.pxi"',
                   "asyncio.exceptions.CancelledError")


def _one_message(err: str) -> str:
    """The one line the server printed for people (its JSON log lines aside); never a traceback of fedguard's."""
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith("{")
             and not x.strip().startswith(_GRPC_CANCELLED)]
    assert len(lines) == 1 and lines[0].startswith("fedserver: "), err
    return lines[0]


@pytest.fixture(scope="module")
def completed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a completed 3-round federation (snapshots of rounds 1, 2, 3)."""
    tmp = tmp_path_factory.mktemp("completed")
    port = _port()
    server = _server(tmp / "run", port)
    clients = _clients(port, tmp)
    try:
        _, err = server.communicate(timeout=120)
        assert server.returncode == 0, err
    finally:
        _stop([server, *clients])
    return tmp / "run"


@pytest.fixture()
def run_dir(completed: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(completed, dest)
    return dest


def _model_files(run_dir: Path, r: int) -> list[Path]:
    return sorted((run_dir / "state" / "models").glob(f"r{r:06d}-*.fgt"))


def test_a_damaged_state_db_stops_the_server_with_exit_2_and_changes_nothing(run_dir: Path) -> None:
    db = run_dir / "state" / "state.db"
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big") or 65536
    assert len(data) >= 3 * page and not (run_dir / "state" / "state.db-wal").exists()  # checkpointed
    for start in range(page, len(data), page):  # flip the header bytes of every page but the first
        for i in range(start, start + 12):
            data[i] ^= 0xA5
    db.write_bytes(bytes(data))
    before = _tree(run_dir)
    rc, err, seconds = _refused(run_dir)
    line = _one_message(err)
    _record("damaged state.db", rc, seconds, line)
    assert rc == 2 and seconds < 15, (rc, seconds, err)
    assert str(db) in line and "--fresh" in line and "restore" in line and "nothing was changed" in line, line
    assert _tree(run_dir) == before
    # The way on: --fresh moves the whole old state aside (kept byte for byte) and starts a new federation.
    rc, err, _ = _refused(run_dir, "--fresh", "--set", "rounds.sampling_timeout_s=1")
    assert rc == 3, err  # the new federation stalls: no clients in this test
    (broken,) = run_dir.glob("state.broken-*")
    assert _tree(broken) == before


def test_no_verifiable_snapshot_stops_the_server_instead_of_starting_over(run_dir: Path) -> None:
    for f in (run_dir / "state" / "models").glob("*.fgt"):
        f.write_bytes(b"garbage")
    before = _tree(run_dir)
    rc, err, seconds = _refused(run_dir)
    line = _one_message(err)
    _record("no verifiable snapshot", rc, seconds, line)
    assert rc == 2 and seconds < 15, (rc, seconds, err)
    assert "no snapshot verifies" in line and "round 3" in line and "round 1" in line and "--fresh" in line, line
    assert _tree(run_dir) == before


def test_a_truncated_model_file_stops_the_server_and_fall_back_quarantines_it(run_dir: Path,
                                                                              tmp_path: Path) -> None:
    (newest,) = _model_files(run_dir, ROUNDS)
    truncated = newest.read_bytes()[:200]
    newest.write_bytes(truncated)
    before = _tree(run_dir)
    rc, err, seconds = _refused(run_dir)
    line = _one_message(err)
    _record("truncated model file", rc, seconds, line)
    assert rc == 2 and seconds < 15, (rc, seconds, err)
    assert "truncated or half-written" in line and "--fall-back to resume from round 2" in line, line
    assert _tree(run_dir) == before
    # The way on, chosen explicitly: resume from round 2; the unverified snapshot is moved aside, not deleted.
    log = tmp_path / "fallback.log"
    port = _port()
    server = _server(run_dir, port, "--fall-back", log=log)
    clients = _clients(port, tmp_path)
    try:
        server.communicate(timeout=120)
    finally:
        _stop([server, *clients])
    assert server.returncode == 0, log.read_text()[-3000:]
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert any(e["event"] == "state.fell_back" and e["completed_rounds"] == 2 for e in events)
    assert any(e["event"] == "federation.resumed" and e["completed_rounds"] == 2 for e in events)
    (kept,) = (run_dir / "state" / "quarantine").glob(f"*/{newest.name}")
    assert kept.read_bytes() == truncated
    rounds = [json.loads(x)["round"] for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert rounds == [1, 2, 3, 3]  # round 3 re-run and appended; nothing truncated


def test_a_second_server_on_the_same_run_dir_exits_at_once_naming_the_first(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = _port()
    first_log = tmp_path / "first.log"
    first = _server(run_dir, port, "--set", "rounds.sampling_timeout_s=60", log=first_log)
    try:
        deadline = time.monotonic() + 60
        # Listening: the new federation's files are all written (the lock names the address before they are).
        while not first_log.exists() or '"server.listening"' not in first_log.read_text():
            assert first.poll() is None and time.monotonic() < deadline, "the first server did not start"
            time.sleep(0.05)
        assert f":{port}" in (run_dir / "server.lock").read_text()
        before = _tree(run_dir)
        rc, err, seconds = _refused(run_dir)
        line = _one_message(err)
        _record("second server", rc, seconds, line)
        assert rc == 2 and seconds < 10, (rc, seconds, err)
        assert f"pid {first.pid}" in line and f"127.0.0.1:{port}" in line and str(run_dir) in line, line
        assert _tree(run_dir) == before and first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    # The lock dies with its holder (kill -9 included): a new server starts without any clean-up step.
    p = _server(run_dir, _port(), "--set", "rounds.sampling_timeout_s=60")
    try:
        deadline = time.monotonic() + 60
        while str(p.pid) not in (run_dir / "server.lock").read_text():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        p.kill()
        p.communicate(timeout=30)
    rc, err, _ = _refused(run_dir, "--set", "rounds.sampling_timeout_s=1")
    assert rc == 3, err  # after kill -9 the run dir is free at once (no stale lock)


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a full disk needs a tmpfs mount: run as root with mount(8)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to make a full disk: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_stops_the_server_with_exit_2_and_keeps_the_last_snapshot(small_disk: Path,
                                                                              tmp_path: Path) -> None:
    run_dir = small_disk / "run"
    port = _port()
    server = _server(run_dir, port, "--rounds", "100000", "--log-level", "error")
    clients = _clients(port, tmp_path)
    filler = small_disk / "filler"
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "rounds.jsonl").exists() or len((run_dir / "rounds.jsonl").read_text().splitlines()) < 3:
            assert server.poll() is None and time.monotonic() < deadline, "no rounds completed"
            time.sleep(0.05)
        with open(filler, "wb") as f:  # fill the disk
            t_full = time.monotonic()
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        _, err = server.communicate(timeout=60)
        seconds = time.monotonic() - t_full
    finally:
        _stop([server, *clients])
    line = _one_message(err)
    _record("full disk", server.returncode, seconds, line)
    assert server.returncode == 2 and seconds < 15, (server.returncode, seconds, err)
    assert "No space left on device" in line or "disk is full" in line, line
    # Which write meets the full disk first is a race: the snapshot (then the store is left intact) or, when SQLite
    # reuses the pages an older snapshot freed, the round's row in rounds.jsonl after it (then the round is in the
    # store and its row is written again on the next start). Either way the message says how to go on.
    assert "intact" in line or "saved in the state store" in line, line
    assert "start the server again" in line, line
    filler.unlink()
    with StateStore(run_dir / "state") as store:
        loaded = store.load()
    assert loaded.snapshot is not None and loaded.skipped == [] and loaded.snapshot.completed_rounds >= 3
    assert len(loaded.history) == loaded.snapshot.completed_rounds
    conn = sqlite3.connect(run_dir / "state" / "state.db")
    assert conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    conn.close()
    # Freed space: the same command resumes from the last committed round.
    log = tmp_path / "resumed.log"
    server = _server(run_dir, port, "--rounds", "100000", log=log)
    try:
        deadline = time.monotonic() + 60
        while '"federation.resumed"' not in (log.read_text() if log.exists() else ""):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        _stop([server])
    resumed = next(json.loads(x) for x in log.read_text().splitlines() if '"federation.resumed"' in x)
    assert resumed["completed_rounds"] == loaded.snapshot.completed_rounds
    # Every committed round has its row, whichever write the full disk refused (a row cut short stays a bad line).
    rows = set()
    for x in (run_dir / "rounds.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            rows.add(json.loads(x)["round"])
    assert set(range(1, loaded.snapshot.completed_rounds + 1)) <= rows
