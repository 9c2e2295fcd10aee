"""fedguard-launch --ray: client hosts as Ray actors on a local Ray instance, the server a process of its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="Ray is not installed (pip install 'fedguard[ray]'; the dev extra has it)")]

ROOT = Path(__file__).resolve().parents[2]


def _launch(run_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": ""}  # a local instance, never a shared cluster
    return subprocess.run([sys.executable, "-m", "fedlaunch", "--clients", "12", "-k", "4", "--rounds", "3",
                           "--procs", "2", "--trainer", "vanilla", "--torch-threads", "1", "--run-dir", str(run_dir),
                           *extra],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def test_ray_actors_run_the_same_federation_as_worker_processes(tmp_path: Path) -> None:
    ray = _launch(tmp_path / "ray", "--ray", "auto", "--ray-cpus", "0.5")
    assert ray.returncode == 0, ray.stdout + ray.stderr
    assert "12 clients (2 Ray actors, 1 torch thread each)" in ray.stdout and "(mutual TLS)" in ray.stdout
    assert "client hosts ok 2/2" in ray.stdout
    rows = [line.split() for line in ray.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    assert [r[0] for r in rows] == ["1", "2", "3"] and all(r[2] == "4" for r in rows)
    procs = _launch(tmp_path / "procs", "--virtual")
    assert procs.returncode == 0, procs.stdout + procs.stderr
    # Same configuration, seed and torch threads, same model bit for bit, whichever backend hosted the clients.
    assert (tmp_path / "ray" / "final_model.fgt").read_bytes() == (tmp_path / "procs" / "final_model.fgt").read_bytes()


def test_bad_ray_resources_are_refused_before_anything_starts(tmp_path: Path) -> None:
    r = _launch(tmp_path / "run", "--ray", "auto", "--ray-resources", "[1, 2]")
    assert r.returncode == 2 and "--ray-resources: must be a JSON object" in r.stderr
    assert not (tmp_path / "run" / "server.log").exists()


def test_hosts_that_cannot_all_run_at_once_are_refused(tmp_path: Path) -> None:
    r = _launch(tmp_path / "run", "--ray", "auto", "--ray-cpus", "64")
    assert r.returncode == 2 and "2 client hosts x 64 CPU = 128 CPU, but the Ray cluster has" in r.stderr
    assert not (tmp_path / "run" / "server.log").exists()
