"""The framed Session transport through the launcher, as real processes: hosts of virtual clients (one shared gRPC
channel per host) each open their clients' framed connections under the launcher's mutual TLS, and none of them
falls back to gRPC (a client that cannot use the port logs ``client.framed_off``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


def test_a_launch_with_the_framed_port_runs_every_virtual_client_on_it(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "fedlaunch", "--clients", "8", "-k", "4", "--rounds", "3", "--virtual",
                        "--procs", "2", "--trainer", "noop", "--server-set", "server.framed_address=127.0.0.1:0",
                        "--run-dir", str(run)], capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "server exit 0; client hosts ok 2/2" in r.stdout, r.stdout[-2000:]
    events = [json.loads(line) for line in (run / "server.log").read_text().splitlines() if line.startswith("{")]
    listening = [e for e in events if e.get("event") == "server.listening"]
    assert listening and listening[0]["transport"] == "mutual-tls" and listening[0]["framed_port"] > 0, listening
    logs = "".join(p.read_text() for p in run.glob("clients-*.log"))
    assert "client.framed_off" not in logs, logs[-2000:]
    rows = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]
    assert [row["accepted"] for row in rows] == [4, 4, 4], rows
