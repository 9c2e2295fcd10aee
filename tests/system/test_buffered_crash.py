"""Real processes: a buffered federation whose server is killed with SIGKILL while a buffer fills, then started
again: it resumes from the last buffer it saved with its devices in flight and the updates the open buffer had
taken (kept in state.db before they were acknowledged, re-folded on resume), and completes every round exactly
once; and a run that follows an uninterrupted run's arrival log, killed mid-buffer and resumed, ends with that
run's model bit for bit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedcore.serialization import load_state
from fedlaunch.hosts import HostSpec, worker_command
from fedlaunch.plan import client_id
from tests.system.test_crash_resume import ROOT, _env, _free_port, _rounds, _wait_for

pytestmark = pytest.mark.system

N, M, C, ROUNDS = 6, 2, 4, 5


def _arrivals(run_dir: Path) -> list[dict[str, int | str]]:
    path = run_dir / "arrivals.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if "arrive" in d:
            out.append(d)
    return out


def test_buffered_server_killed_mid_buffer_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = _free_port()
    server_args = ["--address", f"127.0.0.1:{port}", "--run-dir", str(run_dir), "--log-json", "--linger", "5",
                   "--insecure", "--rounds", str(ROUNDS), "--clients-per-round", str(M), "--min-available", str(N),
                   "--set", "rounds.mode='buffered'", "--set", f"rounds.concurrency={C}",
                   "--set", "rounds.round_timeout_s=20.0"]
    logs = open(tmp_path / "server.log", "ab")  # noqa: SIM115

    def server() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "fedserver", *server_args], cwd=ROOT, env=_env(),
                                stdout=logs, stderr=subprocess.STDOUT)

    spec = HostSpec(f"127.0.0.1:{port}", 0, N, backoff_max=0.3,
                    simulation={client_id(i): {"straggler": "lognormal", "straggler_delay_s": 0.5,
                                               "straggler_sigma": 1.0} for i in range(N)})
    client_log = open(tmp_path / "clients.log", "ab")  # noqa: SIM115 (a file: a full pipe would block the clients)
    clients = subprocess.Popen(worker_command(spec, tmp_path / "host.json"),
                               cwd=ROOT, env=_env(), stdout=client_log, stderr=subprocess.STDOUT)
    p = None
    try:
        p = server()
        # SIGKILL once round 2 is saved and round 3's buffer holds an update (mid-buffer)
        _wait_for(lambda: len(_rounds(run_dir)) >= 2 and any(int(d["round"]) > len(_rounds(run_dir))
                                                              for d in _arrivals(run_dir)), 120, "a buffer filling")
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        saved = len(_rounds(run_dir))
        lost = [d for d in _arrivals(run_dir) if int(d["round"]) > saved]
        assert lost, "the kill did not land mid-buffer"
        time.sleep(0.5)
        p = server()
        assert p.wait(180) == 0
        assert clients.wait(60) == 0, (tmp_path / "clients.log").read_text()[-3000:]
    finally:
        for proc in (clients, p):
            if proc is not None and proc.poll() is None:
                proc.kill()
        logs.close()
        client_log.close()
    assert _rounds(run_dir) == list(range(1, ROUNDS + 1)), "a buffer was lost or applied twice"
    events = [json.loads(x) for x in (tmp_path / "server.log").read_text().splitlines() if x.startswith("{")]
    resumed = [e["completed_rounds"] for e in events if e["event"] == "federation.resumed"]
    # (saved + 1 when the kill fell between a buffer's snapshot and its rounds.jsonl row: the row is re-appended)
    assert len(resumed) == 1 and resumed[0] in (saved, saved + 1)
    if resumed[0] == saved:  # the open buffer had taken an update: kept, and re-folded on resume
        restored = [e for e in events if e["event"] == "buffer.restored"]
        assert len(restored) == 1 and restored[0]["round"] == saved + 1 and restored[0]["updates"] >= 1
    # the arrival log matches the state: M arrivals per buffer, the lost buffer's lines dropped on resume
    arrivals = _arrivals(run_dir)
    assert sorted(int(d["round"]) for d in arrivals) == sorted(list(range(1, ROUNDS + 1)) * M)
    rows = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert all(r["accepted"] == M and r["staleness_max"] <= 10 for r in rows)


def _federation(tmp_path: Path, name: str, kill_mid_buffer: bool, replay: Path | None = None) -> Path:
    """A buffered federation of two real devices (M = C = N = 2: every buffer holds both devices' updates, and no
    device holds a task across a buffer's snapshot), the server killed with SIGKILL while a buffer holds one update
    when ``kill_mid_buffer``, then started again. Returns the run directory."""
    n, rounds = 2, 3
    run_dir, logs_path = tmp_path / name / "run", tmp_path / name / "server.log"
    run_dir.parent.mkdir(parents=True)
    port = _free_port()
    server_args = ["--address", f"127.0.0.1:{port}", "--framed-address", "127.0.0.1:0", "--run-dir", str(run_dir),
                   "--log-json", "--linger", "2", "--insecure", "--rounds", str(rounds), "--clients-per-round", "2",
                   "--min-available", str(n), "--set", "rounds.mode='buffered'", "--set", "rounds.concurrency=2",
                   "--set", "rounds.round_timeout_s=20.0"]
    if replay is not None:
        server_args += ["--set", f"rounds.replay='{replay}'"]
    logs = open(logs_path, "ab")  # noqa: SIM115

    def server() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "fedserver", *server_args], cwd=ROOT, env=_env(),
                                stdout=logs, stderr=subprocess.STDOUT)

    # client 1 is slow: a buffer holds client 0's update for about a second before client 1's arrives
    spec = HostSpec(f"127.0.0.1:{port}", 0, n, backoff_max=0.3,
                    simulation={client_id(1): {"straggler": "fixed", "straggler_delay_s": 1.0}})
    client_log = open(tmp_path / name / "clients.log", "ab")  # noqa: SIM115
    clients = subprocess.Popen(worker_command(spec, tmp_path / name / "host.json"),
                               cwd=ROOT, env=_env(), stdout=client_log, stderr=subprocess.STDOUT)
    p = None
    try:
        p = server()
        if kill_mid_buffer:
            _wait_for(lambda: len(_rounds(run_dir)) >= 1 and any(int(d["round"]) > len(_rounds(run_dir))
                                                                 for d in _arrivals(run_dir)), 120, "a buffer filling")
            p.send_signal(signal.SIGKILL)
            p.wait(30)
            time.sleep(0.5)
            p = server()
        assert p.wait(120) == 0, logs_path.read_text()[-3000:]
        assert clients.wait(60) == 0, (tmp_path / name / "clients.log").read_text()[-3000:]
    finally:
        for proc in (clients, p):
            if proc is not None and proc.poll() is None:
                proc.kill()
        logs.close()
        client_log.close()
    assert _rounds(run_dir) == list(range(1, rounds + 1))
    return run_dir


def test_killed_mid_buffer_the_resumed_server_refolds_the_buffer_bit_for_bit(tmp_path: Path) -> None:
    """The updates a buffer had taken when the server was killed are durable (state.db) and re-folded in their
    arrival order on resume: following the uninterrupted run's arrival log, the killed-and-resumed run ends with
    the same model bit for bit."""
    first = _federation(tmp_path, "first", kill_mid_buffer=False)
    second = _federation(tmp_path, "second", kill_mid_buffer=True, replay=first / "arrivals.jsonl")
    events = [json.loads(x) for x in (tmp_path / "second" / "server.log").read_text().splitlines()
              if x.startswith("{")]
    restored = [e for e in events if e["event"] == "buffer.restored"]
    assert len(restored) == 1 and restored[0]["updates"] >= 1, "the resumed server re-folded no buffered update"
    assert sorted((d["round"], d["arrive"], d["base"]) for d in _arrivals(second)) == sorted(
        (d["round"], d["arrive"], d["base"]) for d in _arrivals(first))
    a, _ = load_state(first / "final_model.fgt")
    b, _ = load_state(second / "final_model.fgt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    print(f"re-folded {restored[0]['updates']} update(s) of round {restored[0]['round']}; models bit-identical")
