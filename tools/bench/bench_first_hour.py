"""The first hour with fedguard-launch, timed: each mistake a new user makes -> seconds to the message that names it,
Ctrl-C return time, the 3-client quickstart's wall time, ``--help`` times (issue 26).

    python tools/bench/bench_first_hour.py                       # this checkout
    python tools/bench/bench_first_hour.py --root /tmp/before  # another checkout (e.g. a git worktree of an old commit)
    python tools/bench/bench_first_hour.py --only typo,k_gt_n    # some scenarios

Every scenario runs real processes (``python -m fedlaunch`` etc. with ``PYTHONPATH=ROOT``) in a temporary
directory and is cut off at its time limit; a row says the seconds to the first output line matching the
scenario's pattern ("-" when none came), the seconds to the launcher's exit and its exit status.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Outcome:
    name: str
    first_match_s: float | None
    exit_s: float | None
    rc: int | None
    matched: str = ""
    note: str = ""
    lines: list[str] = field(default_factory=list)
    # CPU seconds (user + system) of the command and the processes it waited for: what the wall time would be on
    # an idle machine, give or take waits (a shared machine's load stretches the wall times, not this).
    cpu_s: float | None = None


def _env(root: Path) -> dict[str, str]:
    # The data of this checkout's machine, wherever ROOT is (a worktree elsewhere has no ../shared/data).
    data = os.environ.get("FEDGUARD_DATA_DIR") or str(Path(__file__).resolve().parents[3] / "shared" / "data")
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONUNBUFFERED": "1", "FEDGUARD_DATA_DIR": data}


def run_timed(name: str, cmd: list[str], root: Path, pattern: str, limit: float,
              signals: tuple[tuple[str, float], ...] = (), cwd: Path | None = None) -> Outcome:
    """Run ``cmd``; time the first stdout/stderr line matching ``pattern`` and the exit. ``signals``: (after
    pattern, delay) pairs: send SIGINT ``delay`` s after the first line matching ``after`` (or after the previous
    signal when ``after`` is empty); the times are then measured from the first signal."""
    t0 = time.monotonic()
    cpu0 = _children_cpu()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(root), cwd=cwd,
                         text=True, start_new_session=True)
    lines: list[str] = []
    first: list[float] = []
    matched: list[str] = []
    seen = threading.Event()
    arm = [re.compile(a) for a, _ in signals]

    def read() -> None:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line.rstrip("\n"))
            if arm and arm[0].search(line):
                seen.set()
            if not first and re.search(pattern, line):
                first.append(time.monotonic())
                matched.append(line.strip()[:160])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t_sig = None
    note = ""
    try:
        for i, (_after, delay) in enumerate(signals):
            if i == 0 and not seen.wait(limit):
                note = "signal never armed"
                break
            time.sleep(delay)
            if p.poll() is not None:
                break
            os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole foreground process group
            t_sig = t_sig or time.monotonic()
            first.clear()
            matched.clear()
        rc = p.wait(timeout=max(0.1, limit - (time.monotonic() - t0)))
        t_exit: float | None = time.monotonic()
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        rc, t_exit, note = None, None, note or f"cut off at {limit:.0f} s"
    reader.join(timeout=2)
    base = t_sig or t0
    return Outcome(name, first[0] - base if first else None, t_exit - base if t_exit else None, rc,
                   matched[0] if matched else "", note, lines, _children_cpu() - cpu0)


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedlaunch", *args]


def scenarios(root: Path, work: Path, only: set[str]) -> list[Outcome]:
    out: list[Outcome] = []

    def want(name: str) -> bool:
        return not only or name in only

    if want("help"):
        for mod in ("fedserver", "fedclient", "fedlaunch"):
            best = min(_timed_help(root, mod) for _ in range(3))
            out.append(Outcome(f"help {mod}", None, best, 0))
    if want("typo"):
        cfg = work / "typo.toml"
        cfg.write_text("[launch]\nclients = 3\n\n[rounds]\nroundz = 3\n")
        out.append(run_timed("typo key [rounds] roundz", launch_cmd("--config", str(cfg), "--run-dir",
                                                                     str(work / "typo")), root, r"roundz", 45))
    if want("missing_data"):
        out.append(run_timed("missing data_dir", launch_cmd(
            "--clients", "3", "--rounds", "2", "--run-dir", str(work / "nodata"), "--server-set",
            "data.dataset=\"mnist\"", "--server-set", "model.name=\"mnist_mlp\"", "--server-set",
            "data.options={data_dir = \"/nonexistent/mnist\", num_clients = 3}"), root,
            r"(?i)data_dir|not found|no such", 60))
    if want("mismatch"):
        out.append(run_timed("model/dataset mismatch", launch_cmd(
            "--clients", "3", "--rounds", "2", "--run-dir", str(work / "mismatch"), "--server-set",
            "data.dataset=\"mnist\"", "--server-set", "data.options={num_clients = 3}"), root,
            r"(?i)model\.name|shape|mat1", 60))
    if want("k_gt_n"):
        out.append(run_timed("K > N (-k 10, 3 clients)", launch_cmd(
            "--clients", "3", "-k", "10", "--rounds", "2", "--run-dir", str(work / "kgtn")), root,
            r"(?i)clients_per_round|K = 10|-k", 40))
    if want("ctrl_c"):
        run = work / "ctrlc"
        o = run_timed("Ctrl-C mid-rounds", launch_cmd(
            "--clients", "3", "--rounds", "3000", "--run-dir", str(run)), root, r"(?i)resume", 60,
            signals=((r"^\s+2\s", 0.0),))
        o.note += " traceback" if any("Traceback" in line for line in o.lines) else ""
        out.append(o)
        if want("resume"):
            r = run_timed("--resume --run-dir RUN alone", launch_cmd("--resume", "--run-dir", str(run)), root,
                          r"^\s+\d+\s+\d+", 60, signals=((r"^\s+\d+\s+\d+", 0.5),))
            r.note += " " + " | ".join(line for line in r.lines if "resum" in line.lower())[:200]
            out.append(r)
    if want("ctrl_c2"):
        o = run_timed("second Ctrl-C", launch_cmd(
            "--clients", "3", "--rounds", "3000", "--run-dir", str(work / "ctrlc2")), root, r"(?i)kill", 60,
            signals=((r"^\s+2\s", 0.0), ("", 0.3)))
        o.note += " traceback" if any("Traceback" in line for line in o.lines) else ""
        out.append(o)
    if want("vanished"):
        out.append(run_timed("vanished clients (dropout 0.3, never back)", launch_cmd(
            "--clients", "6", "-k", "3", "--min-updates", "1", "--min-available", "3", "--rounds", "6",
            "--round-timeout", "3", "--dropout", "0.3", "--dropout-return", "-1", "--trainer", "noop",
            "--server-set", "server.heartbeat_patience_s=2", "--server-set", "server.heartbeat_interval_s=0.5",
            "--run-dir", str(work / "vanish")), root, r"(?i)lost|vanish", 90))
    if want("quickstart"):
        out.append(run_timed("launcher, 3 clients, 20 rounds", launch_cmd(
            "--clients", "3", "--rounds", "20", "--run-dir", str(work / "qs")), root, r"server exit|wall", 200))
        out.append(quickstart_standalone(root, work))
    return out


def _timed_help(root: Path, mod: str) -> float:
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", mod, "--help"], env=_env(root), capture_output=True, check=True)
    return time.monotonic() - t


def quickstart_standalone(root: Path, work: Path, rounds: int = 20) -> Outcome:
    """The README quickstart on one machine: fedserver plus 3 fedclient processes, default thread settings."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    cpu0 = _children_cpu()
    env = _env(root)
    server = subprocess.Popen([sys.executable, "-m", "fedserver", "--insecure", "--address", f"127.0.0.1:{port}",
                               "--rounds", str(rounds), "-k", "3", "--run-dir", str(work / "qs3"), "--fresh",
                               "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    clients = [subprocess.Popen([sys.executable, "-m", "fedclient", "--insecure", "--server", f"127.0.0.1:{port}",
                                 "--data-index", str(i), "--log-level", "warning"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(3)]
    try:
        rc = server.wait(timeout=300)
        t = time.monotonic() - t0
    except subprocess.TimeoutExpired:
        server.kill()
        rc, t = None, None
    for c in clients:
        try:
            c.wait(timeout=30)
        except subprocess.TimeoutExpired:
            c.kill()
    return Outcome(f"fedserver + 3 fedclient processes, {rounds} rounds", None, t, rc, cpu_s=_children_cpu() - cpu0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    ap.add_argument("--only", default="", help="comma-separated: help, typo, missing_data, mismatch, k_gt_n, "
                                               "ctrl_c, resume, ctrl_c2, vanished, quickstart")
    ap.add_argument("--verbose", action="store_true", help="print each scenario's last output lines")
    args = ap.parse_args()
    only = {s for s in args.only.split(",") if s}
    with tempfile.TemporaryDirectory(prefix="fedguard-first-hour-") as tmp:
        for o in scenarios(Path(args.root).resolve(), Path(tmp), only):
            fm = "-" if o.first_match_s is None else f"{o.first_match_s:.2f}"
            ex = "-" if o.exit_s is None else f"{o.exit_s:.2f}"
            cpu = "-" if o.cpu_s is None else f"{o.cpu_s:.2f}"
            print(f"{o.name:<45} message {fm:>6} s  exit {ex:>6} s  cpu {cpu:>6} s  rc {o.rc}  {o.note.strip()}  "
                  f"{o.matched}", flush=True)
            if args.verbose:
                print("    " + "\n    ".join(o.lines[-12:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
