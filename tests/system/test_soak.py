"""Real processes: ``tools/bench/soak.py`` at a tiny scale (40 virtual clients, K = 8, 1 minute, churn every 20 s,
the server killed with SIGKILL at 0.5 min and resumed; the soak ends once the resumed server has completed a
round): the samples are there for both server processes, with the asyncio tasks and threads the operator's
GetStatus reports, the restart resumed the federation, and no round was lost beyond the one the kill
interrupted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]


def test_a_tiny_soak_samples_the_server_through_a_kill_and_loses_no_round(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    run = subprocess.run(
        [sys.executable, "tools/bench/soak.py", "--minutes", "1.0", "--clients", "40", "-k", "8", "--procs", "4",
         "--kill-at", "0.5", "--sample-s", "5", "--churn", "0.25", "--churn-every", "20", "--start-timeout", "240",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    # One sample every 5 s over a minute (those due while the server restarts lack its GetStatus fields).
    assert len(samples) >= 12, len(samples)
    pids = sorted({s["pid"] for s in samples}, key=lambda p: min(s["t_min"] for s in samples if s["pid"] == p))
    assert len(pids) == 2, "the killed server and its successor"
    for pid in pids:
        answered = [s for s in samples if s["pid"] == pid and s["asyncio_tasks"] is not None]
        assert answered, f"no sample of server {pid} with its GetStatus"
        for s in answered:
            assert s["asyncio_tasks"] > 0 and s["py_threads"] >= 1 and s["threads"] >= s["py_threads"]
            assert s["rss_mib"] > 0 and s["fds"] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == 1, "the second server resumed the federation (federation.resumed)"
    assert summary["churn_events"] >= 2
    assert summary["rounds_contiguous"], "rounds.jsonl has a gap or a round twice"
    assert summary["killed_round"] is not None and summary["rounds_rows"] >= summary["killed_round"], \
        "the round in flight at the kill was re-run and completed"
    assert summary["rounds_lost_beyond_killed"] == 0, summary
    assert not summary["logs"]["unexplained"], summary["logs"]
    # Drift per server process; the first one's windows (after its warm-up, before the kill) are always sampled.
    assert len(summary["drift"]) == 2
    assert all(summary["drift"][0][m]["drift_pct"] is not None for m in ("rss_mib", "fds", "asyncio_tasks", "threads"))
    assert (out / "soak.png").stat().st_size > 0 and "asyncio tasks" in (out / "soak.md").read_text()
