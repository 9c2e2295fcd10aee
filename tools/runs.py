"""What the experiment drivers (``tools/experiments/nfl_experiment.py``, ``tools/experiments/distfl_experiment.py``,
``tools/experiments/kd_experiment.py``) share: reading a run directory the launcher wrote, deciding whether a run is
new,
finished or to be resumed, the run's record (``record.json`` beside its ``rounds.jsonl``: every sitting's command,
versions, seed, wall time and rounds), the environment of the runs they start, and the number formatting of their
tables.

A campaign spans several sittings (a machine's command limit, a session's end): running the same command again
skips the finished runs and resumes the unfinished ones (``fedguard-launch --resume``: the server goes on from its
last completed round). The runner only ever touches a run directory it wrote itself: one that holds files but no
readable record, or whose record names another experiment, stops the runner with a message instead
(:class:`RunDirError`); nothing is moved or deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fedcore import jsonio
from fedcore.report import row_from_json

ROOT = Path(__file__).resolve().parent.parent
RECORD = "record.json"


class RunDirError(RuntimeError):
    """A run directory the runner must not touch (not written by it, unreadable, or another experiment's)."""


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(a tool's own arguments, the ones after ``--`` it passes on to the command it runs)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def finished(run_dir: Path) -> bool:
    """Whether the run's server completed its federation: its last ``federation.finished`` log event says
    "completed", or "dp_budget" (its privacy budget is spent: running it again runs no round). A stalled federation
    writes its final model too, and is resumed by running it again."""
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
            return event.get("outcome", "completed") in ("completed", "dp_budget")
    return False


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``rounds.jsonl`` rows (empty when it has none yet); ``run_dir`` may also be the file itself."""
    path = run_dir if run_dir.name.endswith("rounds.jsonl") else run_dir / "rounds.jsonl"
    if not path.exists():
        return []
    # null (strict JSON's NaN) reads back as NaN: the figures below compute with NaN as before
    return [row_from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def finite_mean(vals: list[float]) -> float:
    """The mean of the values that are neither None nor NaN; NaN when none is."""
    kept = [v for v in vals if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def fmt(v: float, digits: int = 3) -> str:
    """A table cell: NaN prints as "-"."""
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def child_env() -> dict[str, str]:
    """The environment of a launched run: one OpenMP thread per process, this checkout importable first (a
    campaign run from a frozen copy, ``git worktree add``, imports that copy, not an editable install)."""
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


# ---- the run's record ----

def read_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path`` (a run directory's ``record.json`` or a collected ``NAME.record.json``); None when
    there is none. RunDirError when it exists but cannot be read."""
    if path.is_dir():
        path = path / RECORD
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path}: unreadable run record ({e}); nothing was changed") from e
    if not isinstance(record, dict) or not isinstance(record.get("spec"), dict) \
            or not isinstance(record.get("sittings"), list):
        raise RunDirError(f"{path}: not a run record written by tools/runs.py; nothing was changed")
    return record


def write_record(run_dir: Path, record: dict[str, Any]) -> None:
    """Write the record atomically (a stop mid-write leaves the previous one)."""
    tmp = run_dir / (RECORD + ".tmp")
    tmp.write_text(jsonio.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, run_dir / RECORD)


def run_state(run_dir: Path, spec: dict[str, Any]) -> str:
    """What to do with ``run_dir`` for the run ``spec`` describes: "new" (absent or empty), "finished" (its
    server completed the federation: skipped, whoever wrote it), or "resume" (this runner's record of the same
    spec, not finished). RunDirError for anything else: files without a readable record (not written by this
    runner), or a record of another spec (the same directory asked to hold a different experiment)."""
    if not run_dir.exists() or (run_dir.is_dir() and not any(run_dir.iterdir())):
        return "new"
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: exists and is not a directory; nothing was changed")
    record = read_record(run_dir)
    if finished(run_dir) and (record is None or record["spec"] == spec):
        return "finished"
    if record is None:
        raise RunDirError(
            f"{run_dir}: holds files but no {RECORD}, so it was not written by this runner (an older runner's or "
            f"someone else's run); nothing was changed. Move it away, or choose another --out.")
    if record["spec"] != spec:
        diff = {k: (record["spec"].get(k), spec.get(k)) for k in sorted(set(record["spec"]) | set(spec))
                if record["spec"].get(k) != spec.get(k)}
        raise RunDirError(f"{run_dir}: its record is of another run ({diff}, recorded vs asked); nothing was "
                          f"changed. Use the recorded settings to resume it, or choose another --out.")
    return "resume"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _version(dist: str) -> str:
    from fedcore.about import installed_version

    return installed_version(dist, missing="")


def versions() -> dict[str, Any]:
    """What produced a sitting: the fedguard commit of the code the runs import (and whether that checkout had
    uncommitted changes to tracked files), where the children import ``fedserver`` from, and package versions."""
    probe = subprocess.run([sys.executable, "-c", "import fedserver, fedclient; print(fedserver.__file__)"],
                           capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120, check=False)
    return {"fedguard_commit": _git("rev-parse", "HEAD"),
            "fedguard_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "fedguard_root": str(ROOT), "child_imports_fedserver_from": probe.stdout.strip() or probe.stderr[-300:],
            "python": platform.python_version(), "torch": _version("torch"), "numpy": _version("numpy"),
            "grpcio": _version("grpcio"), "platform": platform.platform(), "cpus": os.cpu_count()}


def now_utc() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


@dataclass
class Running:
    """One sitting of one run: its launcher process, log and record."""

    name: str
    run_dir: Path
    proc: subprocess.Popen[bytes]
    log: IO[bytes]
    record: dict[str, Any]
    started: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        """SIGTERM the run's process group: the server exits resumable (4) with its completed rounds on disk."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def close(self) -> int:
        """Record the sitting's end (exit code, wall time, rounds reached, finished) and close the log."""
        rc = self.proc.wait()
        self.log.close()
        sitting = self.record["sittings"][-1]
        rows = read_rows(self.run_dir)
        sitting.update(ended_utc=now_utc(), wall_s=round(self.elapsed(), 1), exit=rc, rounds_after=len(rows))
        self.record.update(rounds=len(rows), finished=finished(self.run_dir),
                           wall_s=round(sum(float(s.get("wall_s") or 0.0) for s in self.record["sittings"]), 1))
        write_record(self.run_dir, self.record)
        return rc


def start_run(name: str, cmd: list[str], run_dir: Path, spec: dict[str, Any], target_rounds: int,
              info: dict[str, Any]) -> Running:
    """Start one sitting of the run ``spec`` in ``run_dir`` (call :func:`run_state` first): ``--resume`` added
    when this runner's record is there (the server resumes from its last completed round, the launcher appends to
    the logs), the record written before the launcher starts, the launcher's output appended to ``launch.txt``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = read_record(run_dir)
    resumed = record is not None
    if record is None:
        record = {"name": name, "spec": spec, "seed": spec.get("seed"), "target_rounds": target_rounds,
                  "sittings": [], "rounds": 0, "finished": False, "wall_s": 0.0}
    if resumed:
        cmd = [*cmd, "--resume"]
    record["sittings"].append({"command": cmd, "cwd": str(ROOT), "started_utc": now_utc(), "ended_utc": None,
                               "resumed": resumed, "rounds_before": len(read_rows(run_dir)), "wall_s": None,
                               "exit": None, **info})
    write_record(run_dir, record)
    log = open(run_dir / "launch.txt", "ab")  # noqa: SIM115 (closed by Running.close)
    log.write(f"# {now_utc()} {' '.join(cmd)}\n".encode())
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT,
                            start_new_session=True)
    return Running(name, run_dir, proc, log, record)


def launch_run(cmd: list[str], run_dir: Path, timeout: float, spec: dict[str, Any] | None = None,
               target_rounds: int = 0) -> int:
    """Run one sitting of one launcher command to its end (the sequential drivers): skipped when finished,
    resumed when this runner's record is there, refused (RunDirError) for a directory it did not write. After
    ``timeout`` seconds (0: none) it is stopped with SIGTERM, so the server exits resumable with its completed
    rounds on disk. Prints and returns the exit code (0 for a finished run)."""
    spec = spec if spec is not None else {"command": [c for c in cmd[1:] if c != "--resume"]}
    if run_state(run_dir, spec) == "finished":
        print(f"{run_dir.name}: already finished", flush=True)
        return 0
    r = start_run(run_dir.name, cmd, run_dir, spec, target_rounds, versions())
    try:
        r.proc.wait(timeout=timeout or None)
    except subprocess.TimeoutExpired:
        r.stop()
    rc = r.close()
    print(f"{run_dir.name}: exit {rc} after {r.elapsed():.0f} s", file=sys.stdout, flush=True)
    return rc


@dataclass(frozen=True)
class Job:
    """A run a campaign will start: its name, run directory, launcher command, spec and the rounds it asks for."""

    name: str
    run_dir: Path
    cmd: list[str]
    spec: dict[str, Any]
    target_rounds: int


def run_jobs(jobs: list[Job], parallel: int, timeout: float = 0.0, until: float = 0.0,
             estimate: Callable[[Job], float] | None = None, log: Callable[[str], None] = print) -> None:
    """Run ``jobs`` in order, ``parallel`` at a time, each as one sitting (:func:`start_run`): a sitting past
    ``timeout`` seconds, or running at the epoch time ``until``, is stopped (resumable); with ``until`` a job
    whose ``estimate`` (wall seconds) would pass it is not started. Every start and end is logged with the time."""
    pending, running = list(jobs), list[Running]()
    info = versions()
    log(f"code: {info['fedguard_commit']} (dirty: {info['fedguard_dirty']}); children import fedserver from "
        f"{info['child_imports_fedserver_from']}")
    t0 = time.monotonic()

    def stamp() -> str:
        return f"[{time.strftime('%H:%M:%S', time.gmtime())} +{time.monotonic() - t0:6.0f}s]"

    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            est = estimate(job) if until and estimate is not None else 0.0
            if until and time.time() + est > until:
                log(f"{stamp()} {job.name}: not started, {est:.0f} s would pass the time limit")
                continue
            r = start_run(job.name, job.cmd, job.run_dir, job.spec, job.target_rounds, info)
            running.append(r)
            log(f"{stamp()} started {job.name}{' (resumed)' if r.record['sittings'][-1]['resumed'] else ''}")
        time.sleep(1.0)
        for r in list(running):
            over = (timeout and r.elapsed() > timeout) or (until and time.time() > until)
            if r.proc.poll() is None and over:
                r.stop()  # the server exits 4 (resumable); its completed rounds are on disk
                log(f"{stamp()} stopped {r.name} at the time limit (resumable)")
            if r.proc.poll() is not None:
                rc = r.close()
                running.remove(r)
                log(f"{stamp()} {r.name} exit {rc} after {r.elapsed():.0f} s, {r.record['rounds']}/"
                    f"{r.record['target_rounds']} rounds{'' if r.record['finished'] else ' (unfinished)'}")


def collect_runs(src: Path, dest: Path, name: re.Pattern[str], partial: bool = False) -> int:
    """Copy the runs of a campaign directory (run directories whose names ``name`` matches) out as
    ``NAME.rounds.jsonl`` and ``NAME.record.json`` for committing: the finished ones (``partial``: also the
    unfinished ones, marked in their record). A collected file is only replaced by a longer run of the same rows
    (never by another run's). Returns how many runs were copied."""
    dest.mkdir(parents=True, exist_ok=True)
    copied = 0
    for d in sorted(p for p in src.iterdir() if p.is_dir() and name.search(p.name)):
        rows_path = d / "rounds.jsonl"
        try:
            record = read_record(d)
        except RunDirError as err:
            print(f"collect: skipped {d.name}: {err}", file=sys.stderr)
            continue
        # A run is collected as finished once its sitting is over (its record closed), not when its server has
        # written the final model while the launcher is still winding down.
        closed = bool(record and record["sittings"] and record["sittings"][-1].get("ended_utc"))
        done = finished(d) and closed
        if not rows_path.exists() or record is None or not (done or partial):
            continue
        new = rows_path.read_text()
        target = dest / f"{d.name}.rounds.jsonl"
        if target.exists() and not new.startswith(target.read_text()):
            print(f"collect: {target} holds other rows than {rows_path}; left as it is", file=sys.stderr)
            continue
        record = {**record, "finished": done, "rounds": len(read_rows(d))}
        if target.exists() and target.read_text() == new and \
                (dest / f"{d.name}.record.json").exists() and read_record(dest / f"{d.name}.record.json") == record:
            continue
        target.write_text(new)
        (dest / f"{d.name}.record.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        copied += 1
        print(f"collected {d.name}: {record['rounds']}/{record.get('target_rounds')} rounds"
              f"{'' if record['finished'] else ' (unfinished)'}")
    print(f"{copied} run(s) copied to {dest}")
    return copied


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table's lines: the header, the separator, one line per row."""
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def opt_text(v: int | None) -> str:
    """A round number for a table: ``-`` for none."""
    return "-" if v is None else str(v)
