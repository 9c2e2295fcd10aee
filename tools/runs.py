"""What the experiment drivers (``tools/nfl_experiment.py``, ``tools/distfl_experiment.py``) share: reading a run
directory the launcher wrote, the environment of the runs they start, and the number formatting of their tables."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def finished(run_dir: Path) -> bool:
    """Whether the run's server completed its federation: its last ``federation.finished`` log event says
    "completed" (a stalled federation writes its final model too, and is resumed by running it again)."""
    if not (run_dir / "final_model.fgt").exists():
        return False
    log = run_dir / "server.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    for line in reversed(lines):
        if '"federation.finished"' in line or '"federation.already_finished"' in line:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            return bool(event.get("outcome", "completed") == "completed")
    return False


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``rounds.jsonl`` rows (empty when it has none yet)."""
    path = run_dir / "rounds.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def finite_mean(vals: list[float]) -> float:
    """The mean of the values that are neither None nor NaN; NaN when none is."""
    kept = [v for v in vals if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def fmt(v: float, digits: int = 3) -> str:
    """A table cell: NaN prints as "-"."""
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def child_env() -> dict[str, str]:
    """The environment of a launched run: one OpenMP thread per process, the checkout importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def launch_run(cmd: list[str], run_dir: Path, timeout: float) -> int:
    """Run one launcher command (``--resume`` added when ``run_dir`` holds a state) with its output appended to
    ``run_dir/launch.txt``; after ``timeout`` seconds (0: none) it is stopped with SIGTERM, so the server exits
    resumable with its completed rounds on disk. Prints and returns the exit code."""
    import subprocess
    import sys
    import time

    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "state").is_dir():
        cmd = [*cmd, "--resume"]
    started = time.monotonic()
    with open(run_dir / "launch.txt", "ab") as log:
        log.write((" ".join(cmd) + "\n").encode())
        log.flush()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                             start_new_session=True)
        try:
            p.wait(timeout=timeout or None)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 15)
            p.wait()
    print(f"{run_dir.name}: exit {p.returncode} after {time.monotonic() - started:.0f} s", file=sys.stdout,
          flush=True)
    return p.returncode
