"""Real processes: bit-identical models across process layouts, and a server killed with SIGKILL at every
stage of a round (training, after aggregation before anything is saved, between the model write and the state
commit, between the commit and the rounds.jsonl append) or stopped with SIGTERM, restarted with the same federation
each time. The kills come from ``tests/crash_server.py`` (the real server with a state store that dies on cue)."""

from __future__ import annotations

import json
import os
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
from fedlaunch.supervise import free_server_port

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
N, ROUNDS = 10, 6
# min_updates = K: bit-identity holds when the same updates are aggregated, so no round may close without one
# (the default, ceil(K/2), lets a round close without a client lost on a loaded machine).
FEDERATION = ["--rounds", str(ROUNDS), "-k", str(N), "--min-available", str(N), "--min-updates", str(N),
              "--round-timeout", "60"]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _free_port() -> int:
    return free_server_port()  # its framed port, P + 1, free too


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_state(run_dir / "final_model.fgt")[0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _launch(run_dir: Path, *flags: str) -> None:
    out = subprocess.run([sys.executable, "-m", "fedlaunch", "--clients", str(N), "--rounds", str(ROUNDS),
                          "--run-dir", str(run_dir), "--min-updates", str(N), "--torch-threads", "1", *flags],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def processes_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    run_dir = tmp_path_factory.mktemp("procs") / "run"
    _launch(run_dir)  # one fedclient process per client
    return _final(run_dir)


def test_ten_processes_and_virtual_clients_give_the_same_model(tmp_path: Path,
                                                               processes_model: dict[str, torch.Tensor]) -> None:
    _launch(tmp_path / "run", "--virtual", "--procs", "2")
    assert _same(_final(tmp_path / "run"), processes_model)


def _rounds(run_dir: Path) -> list[int]:
    path = run_dir / "rounds.jsonl"
    return [json.loads(x)["round"] for x in path.read_text().splitlines()] if path.exists() else []


def _started(log: Path, round_: int) -> int:
    return sum(1 for x in log.read_text().splitlines()
               if '"round.started"' in x and json.loads(x).get("round") == round_)


def _wait_for(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_server_killed_at_every_stage_resumes_to_the_uninterrupted_model(
        tmp_path: Path, processes_model: dict[str, torch.Tensor]) -> None:
    run_dir = tmp_path / "run"
    port = _free_port()
    server_args = ["--address", f"127.0.0.1:{port}", "--run-dir", str(run_dir), "--log-json", "--linger", "5",
                   "--insecure", *FEDERATION]
    logs = open(tmp_path / "server.log", "ab")  # noqa: SIM115

    def server(crash_at: str = "") -> subprocess.Popen[bytes]:
        main = ["tests.crash_server", crash_at] if crash_at else ["fedserver"]
        return subprocess.Popen([sys.executable, "-m", *main, *server_args], cwd=ROOT, env=_env(), stdout=logs,
                                stderr=subprocess.STDOUT)

    # Ten clients in one process; they outlive every server and re-join each new one unaided.
    spec = HostSpec(f"127.0.0.1:{port}", 0, N, backoff_max=0.3,
                    simulation={client_id(i): {"straggler_delay_s": 0.3} for i in range(N)})
    clients = subprocess.Popen(worker_command(spec, tmp_path / "host.json"),
                               cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # SIGKILL after round 2 was aggregated but before any of it was saved, between round 3's model write and
        # its state commit, and between round 4's commit and its rounds.jsonl row.
        for point in ("saving:2", "files_written:3", "committed:4"):
            p = server(crash_at=point)
            assert p.wait(120) == -signal.SIGKILL, f"the server did not die at {point}"
        assert _rounds(run_dir) == [1, 2, 3], "rounds 2 and 3 are re-run; round 4 committed without its row"
        # SIGKILL while clients train round 5 (restored round 4's row is appended on start).
        p = server()
        _wait_for(lambda: _rounds(run_dir) == [1, 2, 3, 4], 120, "round 4's row")
        _wait_for(lambda: _started(tmp_path / "server.log", 5) >= 1, 120, "round 5 to start")
        time.sleep(0.1)
        p.kill()
        p.wait(30)
        # SIGTERM: a graceful stop is resumable and exits 4.
        p = server()
        _wait_for(lambda: len(_rounds(run_dir)) >= 5, 120, "round 5")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 4
        done = _rounds(run_dir)
        # The last start finishes the federation.
        p = server()
        assert p.wait(180) == 0
        assert clients.wait(60) == 0, clients.stdout.read().decode() if clients.stdout else ""
    finally:
        for proc in (clients,):
            if proc.poll() is None:
                proc.kill()
        logs.close()
    assert done[:5] == [1, 2, 3, 4, 5]
    assert _rounds(run_dir) == list(range(1, ROUNDS + 1)), "a round was lost or applied twice"
    events = [json.loads(x) for x in (tmp_path / "server.log").read_text().splitlines() if x.startswith("{")]
    resumed = [e["completed_rounds"] for e in events if e["event"] == "federation.resumed"]
    assert resumed[:3] == [1, 2, 4] and len(resumed) == 5
    assert _same(_final(run_dir), processes_model)
