"""Real processes under secure aggregation: four device processes are killed with SIGKILL in round 1, one at each
phase (before advertising its keys, before its shares, before its masked input, before revealing its shares), and
the round still completes with the right survivor set, then the federation goes on with the rest. The kills come
from ``tests/secagg_client.py`` (the real client, dying on cue)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedlaunch.hosts import HostSpec, worker_command
from fedlaunch.plan import client_id
from fedlaunch.supervise import free_server_port

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
HEALTHY = 6
PHASES = ("advertisement", "shares", "masked", "unmask")
K = HEALTHY + len(PHASES)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    return free_server_port()  # its framed port, P + 1, free too


def test_devices_killed_at_each_phase_leave_correct_rounds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "fedserver", "--address", f"127.0.0.1:{port}", "--run-dir", str(run_dir),
         "--log-json", "--linger", "3", "--insecure", "--rounds", "2", "--set", f"rounds.clients_per_round={K}",
         "--set", f"rounds.min_available={K}", "--set", "rounds.round_timeout_s=60",
         "--set", 'aggregation.secure="secagg+"', "--set", "secagg.phase_timeout_s=4",
         "--set", "server.heartbeat_interval_s=1", "--set", "server.heartbeat_patience_s=4",
         "--set", "training.local_epochs=1"],
        cwd=ROOT, env=_env(), stdout=open(tmp_path / "server.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    spec = HostSpec(f"127.0.0.1:{port}", 0, HEALTHY, backoff_max=0.3)
    healthy = subprocess.Popen(worker_command(spec, tmp_path / "host.json"), cwd=ROOT, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    dying = {phase: subprocess.Popen(
        [sys.executable, "-m", "tests.secagg_client", phase, "--server", f"127.0.0.1:{port}", "--insecure",
         "--client-id", client_id(HEALTHY + i), "--data-index", str(HEALTHY + i), "--torch-threads", "1",
         "--long-poll", "5"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i, phase in enumerate(PHASES)}
    try:
        assert server.wait(300) == 0, (tmp_path / "server.log").read_text()[-3000:]
        assert healthy.wait(60) == 0, healthy.stdout.read().decode() if healthy.stdout else ""
        for phase, p in dying.items():
            assert p.wait(30) == -signal.SIGKILL, f"the device meant to die at {phase} exited {p.returncode}"
    finally:
        for p in (server, healthy, *dying.values()):
            if p.poll() is None:
                p.kill()
    rows = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    first, second = rows
    # Round 1: ten selected, nine advertised keys; three of them dropped later (at most a third may), one of those
    # after its masked input was summed: seven inputs in the sum, all four losses counted.
    m1, m2 = first["metrics"], second["metrics"]
    assert first["attempt"] == 0
    assert m1["secagg_participants"] == K - 1
    assert m1["secagg_survivors"] == HEALTHY + 1 == first["accepted"] == m1["num_updates"]
    assert m1["secagg_dropped"] == len(PHASES)
    # Round 2: the six devices left (the last one killed may still look alive when it starts: then it is selected
    # and dropped before advertising).
    assert second["attempt"] == 0
    assert m2["secagg_survivors"] == HEALTHY and m2["secagg_dropped"] <= 1
