"""A soak: a fleet of virtual clients under churn, stragglers and a server crash for an hour; does the server stay flat?

A ``fedserver`` (plaintext, the 4,554-parameter ``mlp`` on the built-in ``synthetic`` data, K of N selected per
round, rounds without end) and ``--procs`` ``fedlaunch worker`` processes hosting ``--clients`` virtual clients
between them (the no-op trainer by default, so the soak measures the system, not training). Injected faults:

- **churn**: every ``--churn-every`` seconds a ``--churn`` fraction of the clients leaves and rejoins: whole worker
  processes, in turn, are stopped with SIGTERM (each of their clients sends its Leave) and started again at once
  (the same client ids join again);
- **stragglers**: a seeded ``--stragglers`` fraction of the clients waits a lognormal delay (median
  ``--straggler-delay`` seconds, log-space sigma 1) before each upload (their ``[simulation]`` fields);
- **a server crash**: at minute ``--kill-at`` the server is killed with SIGKILL and started again at once with the
  same command on the same run directory (it resumes; the round in flight is re-run).

The clock starts when the first round completes (the fleet is up). Every ``--sample-s`` seconds the server's RSS
and private memory (/proc/PID/status), its open file descriptors (/proc/PID/fd), its OS threads and, from the
operator's GetStatus (its trailing metadata, ``fedserver.servicer.process_metadata``), its asyncio tasks and
Python threads, with the round and the clients alive, go to ``samples.jsonl``. At the end (SIGTERM: the server
stops gracefully) the soak reports, per server process: each metric's drift after warm-up (the median of the
samples in the segment's second sixth against its last sixth: minutes 5-10 against 25-30 and 35-40 against 55-60
for an hour with the kill at 30), the rounds completed and whether ``rounds.jsonl`` is contiguous, the rounds lost
(the one the kill interrupted, and any abandoned attempt), and every warning or error in the server's and the
clients' logs that is not an injected fault's expected trace. ``--out DIR`` keeps it all: the logs, the run dir,
``samples.jsonl``, ``summary.json``, ``soak.md`` (a Markdown block) and ``soak.png`` (the plot).

    python tools/bench/soak.py --out /tmp/soak                      # 60 minutes, 1,000 clients, K = 100, kill at 30
    python tools/bench/soak.py --minutes 1.5 --clients 40 -k 8 --procs 4 --kill-at 0.75 --sample-s 5 --churn-every 20 \\
        --churn 0.25 --out /tmp/soak-small
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from tools.procstat import free_port  # noqa: E402

METRICS = ("rss_mib", "fds", "asyncio_tasks", "threads")
# Also compared, not part of the goal: the Python threads, the private memory, and the asyncio tasks per client
# alive (the tasks follow the fleet: each connected client's parked call has its task; churn moves them).
EXTRA = ("py_threads", "rss_anon_mib", "tasks_per_client")
LABELS = {"rss_mib": "RSS (MiB)", "fds": "open file descriptors", "asyncio_tasks": "asyncio tasks",
          "threads": "OS threads", "py_threads": "Python threads", "rss_anon_mib": "RssAnon (MiB)",
          "tasks_per_client": "asyncio tasks per client alive"}
GOAL_DRIFT_PCT = 5.0
# Warnings and errors that the injected faults cause by design, with the fault: not findings.
EXPECTED = {
    ("server", "server.stopping"): "the soak's final SIGTERM (a graceful stop)",
    ("server", "security.insecure"): "plaintext soak: one per server start (the restart included)",
    ("client", "security.insecure"): "plaintext soak: one per worker process start (restarts included)",
}
# Events expected only in the minutes after the server's SIGKILL: the new server knows none of the old sessions
# (a client's next call on its old session, an update of the killed round included, is refused "unknown session;
# join first" and it joins again), the clients retry while no server listens, and a client whose framed Session
# connection (the server's framed port) is refused while the server is down uses gRPC's until its next join.
AFTER_KILL = {("server", "rpc.refused"): "unknown session", ("client", "update.refused"): "unknown session",
              ("client", "client.retrying"): "", ("client", "client.rejoining"): "",
              ("client", "update.resending"): "", ("client", "client.connecting"): "",
              ("client", "client.framed_off"): ""}
AFTER_KILL_S = 180.0
# Events expected once the soak ends: every client leaves first (the round in flight loses its clients), then the
# server stops.
AFTER_STOP = {("server", "round.abandoned"), ("server", "client.dropped")}


def _proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "Threads"):
                    out[key] = int(rest.split()[0])
    except OSError:
        pass
    return out


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


@dataclass
class Soak:
    """The processes of one soak and what happened to them."""

    args: argparse.Namespace
    out: Path
    address: str = ""
    operator: str = field(default_factory=lambda: secrets.token_urlsafe(18))
    server: subprocess.Popen[bytes] | None = None
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    worker_cmds: list[list[str]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    t0: float = 0.0  # monotonic time of the soak's minute 0
    wall0: float = 0.0
    killed_rows: int | None = None  # rows of rounds.jsonl when the server was killed

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

    def minutes(self) -> float:
        return (time.monotonic() - self.t0) / 60.0 if self.t0 else 0.0

    def note(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, "t_min": round(self.minutes(), 4), "time": time.time(), **fields})
        print(f"[{self.minutes():6.2f} min] {kind} {json.dumps(fields)}", file=sys.stderr, flush=True)

    def start_server(self) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "fedserver", "--address", self.address, "--run-dir", str(self.out / "run"),
               "--insecure", "--rounds", "1000000", "-k", str(a.k), "--model", "mlp", "--dataset", "synthetic",
               "--seed", str(a.seed), "--round-timeout", str(a.round_timeout), "--log-json", "--log-level", "info",
               "--linger", "5"]
        log = open(self.out / "server.log", "ab")  # noqa: SIM115  (one log across the server's lives)
        self.server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                       env={**self.env(), "FEDGUARD_OPERATOR_TOKEN": self.operator})
        log.close()

    def start_worker(self, i: int) -> None:
        log = open(self.out / f"worker-{i}.log", "ab")  # noqa: SIM115
        p = subprocess.Popen(self.worker_cmds[i], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env())
        log.close()
        if i < len(self.workers):
            self.workers[i] = p
        else:
            self.workers.append(p)

    def plan_workers(self) -> None:
        from fedlaunch.hosts import HostSpec, worker_command
        from fedlaunch.plan import client_id

        a = self.args
        n = a.clients
        rng = random.Random(a.seed)  # which clients straggle: seeded for this purpose only
        stragglers = set(rng.sample(range(n), round(a.stragglers * n)))
        sim = {client_id(i): ({"straggler": "lognormal", "straggler_delay_s": a.straggler_delay,
                               "straggler_sigma": 1.0, "seed": a.seed} if i in stragglers else {})
               for i in range(n)}
        per = -(-n // a.procs)
        for first in range(0, n, per):
            count = min(per, n - first)
            spec = HostSpec(self.address, first, count, trainer=a.trainer, backoff_max=a.backoff_max,
                            simulation={client_id(i): sim[client_id(i)] for i in range(first, first + count)})
            self.worker_cmds.append(worker_command(spec, self.out / "hosts" / f"host-{first}.json"))

    def status(self) -> tuple[Any, dict[str, str]] | None:
        """The operator's GetStatus (no history) and its trailing metadata; None while the server does not answer."""
        import grpc

        from fedguard.v1 import fedguard_pb2 as pb

        with grpc.insecure_channel(self.address) as channel:
            call = channel.unary_unary("/fedguard.v1.Federation/GetStatus", pb.StatusRequest.SerializeToString,
                                       pb.StatusReply.FromString)
            try:
                reply, rpc = call.with_call(pb.StatusRequest(since_round=2**62), timeout=15,
                                            metadata=(("fg-operator", self.operator),))
            except grpc.RpcError:
                return None
            return reply, {k: str(v) for k, v in (rpc.trailing_metadata() or ())}

    def sample(self) -> dict[str, Any]:
        assert self.server is not None
        pid = self.server.pid
        st = _proc_status(pid)
        got = self.status()
        row: dict[str, Any] = {"t_min": round(self.minutes(), 4), "time": time.time(), "pid": pid,
                               "rss_mib": st["VmRSS"] / 1024 if "VmRSS" in st else None,
                               "rss_anon_mib": st["RssAnon"] / 1024 if "RssAnon" in st else None,
                               "fds": _fds(pid), "threads": st.get("Threads")}
        if got is not None:
            reply, meta = got
            row.update(round=int(reply.round), clients_alive=int(reply.clients_alive),
                       asyncio_tasks=int(meta["fg-asyncio-tasks"]) if "fg-asyncio-tasks" in meta else None,
                       py_threads=int(meta["fg-threads"]) if "fg-threads" in meta else None)
        else:
            row.update(round=None, clients_alive=None, asyncio_tasks=None, py_threads=None)
        with open(self.out / "samples.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    def rounds_done(self) -> int:
        path = self.out / "run" / "rounds.jsonl"
        try:
            return sum(1 for line in path.read_bytes().splitlines() if line.strip())
        except FileNotFoundError:
            return 0

    def churn(self, turn: int) -> None:
        """Stop ``--churn`` of the clients (whole workers, in turn) with SIGTERM, then start them again."""
        a = self.args
        many = max(1, round(a.churn * len(self.workers)))
        for j in range(many):
            i = (turn * many + j) % len(self.workers)
            p = self.workers[i]
            t = time.monotonic()
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = p.wait()
            self.note("churn", worker=i, exit=rc, stop_s=round(time.monotonic() - t, 2))
            self.start_worker(i)

    def kill_server(self) -> None:
        assert self.server is not None
        before = self.rounds_done()
        old = self.server.pid
        signalled = time.time()
        self.server.send_signal(signal.SIGKILL)
        self.server.wait()
        self.killed_rows = before
        self.note("server_killed", pid=old, rounds_before=before, signalled=signalled)
        self.start_server()
        self.note("server_restarted", pid=self.server.pid)

    def stop_all(self) -> int | None:
        """The clients leave first (SIGTERM to every worker: each client sends its Leave while the server still
        answers), then the server stops gracefully (SIGTERM: exit 4, resumable); its exit status."""
        for p in self.workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.workers:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        rc = None
        if self.server is not None:
            if self.server.poll() is None:
                self.server.send_signal(signal.SIGTERM)
            try:
                rc = self.server.wait(120)
            except subprocess.TimeoutExpired:
                self.server.kill()
                rc = self.server.wait()
        return rc

    def run(self) -> int | None:
        a = self.args
        self.address = f"127.0.0.1:{free_port()}"
        self.plan_workers()
        self.start_server()
        for i in range(len(self.worker_cmds)):
            self.start_worker(i)
        self.note("started", server_pid=self.server.pid if self.server else None, workers=len(self.workers))
        deadline = time.monotonic() + a.start_timeout
        while self.rounds_done() < 1:
            assert self.server is not None
            if self.server.poll() is not None:
                raise SystemExit(f"the server exited ({self.server.returncode}) before the first round: "
                                 + (self.out / "server.log").read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise SystemExit(f"no round completed within {a.start_timeout} s of the start")
            time.sleep(0.5)
        self.t0, self.wall0 = time.monotonic(), time.time()
        self.note("minute_0", rounds=self.rounds_done())
        end = a.minutes * 60.0
        next_sample, next_churn, turn, killed = 0.0, a.churn_every, 0, False
        while True:
            now = time.monotonic() - self.t0
            if now >= next_sample:
                self.sample()
                next_sample += a.sample_s
            # The end, but not before the resumed server has completed a round (a restart on a loaded machine
            # can take most of a short soak's second half), nor later than --start-timeout past it.
            if now >= end and (self.killed_rows is None or self.rounds_done() > self.killed_rows
                               or now >= end + a.start_timeout):
                break
            if not killed and now >= a.kill_at * 60.0:
                self.kill_server()
                killed = True
            if a.churn > 0 and now >= next_churn:
                self.churn(turn)
                turn += 1
                next_churn += a.churn_every
            assert self.server is not None
            if self.server.poll() is not None:
                self.note("server_exited", rc=self.server.returncode)
                break
            for i, p in enumerate(self.workers):
                if p.poll() is not None:
                    self.note("worker_exited", worker=i, rc=p.returncode)
                    self.start_worker(i)
            time.sleep(max(0.0, min(0.5, next_sample - (time.monotonic() - self.t0))))
        self.note("stopping")
        rc = self.stop_all()
        self.note("stopped", server_exit=rc)
        return rc


# ---- the analysis (from the out dir alone) ----

def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _json_lines(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The JSON objects of a log, and its lines that are not JSON."""
    objs: list[dict[str, Any]] = []
    other: list[str] = []
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            other.append(line)
            continue
        if isinstance(obj, dict):
            objs.append(obj)
        else:
            other.append(line)
    return objs, other


def drift(samples: list[dict[str, Any]], start: float, end: float) -> dict[str, dict[str, float | None]]:
    """Each metric's median over the segment's second sixth (after warm-up) and its last sixth, and the drift in %."""
    length = end - start
    early = [s for s in samples if start + length / 6 <= s["t_min"] <= start + length / 3]
    late = [s for s in samples if end - length / 6 <= s["t_min"] <= end]
    out: dict[str, dict[str, float | None]] = {}
    for m in (*METRICS, *EXTRA):
        e = [s[m] for s in early if s.get(m) is not None]
        la = [s[m] for s in late if s.get(m) is not None]
        a = statistics.median(e) if e else None
        b = statistics.median(la) if la else None
        out[m] = {"early": a, "late": b, "n_early": len(e), "n_late": len(la),
                  "drift_pct": 100.0 * (b - a) / a if a and b is not None else None}
    return out


# Non-JSON lines that every worker process writes by design when it ends.
_WORKER_END = "finished, "


def scan_logs(out: Path, kills: list[float], stop: float | None) -> dict[str, Any]:
    """Every warning and error in the server's and the workers' logs: counted by event, split into the injected
    faults' expected traces and the rest (the findings), with an example of each."""
    found: dict[str, Counter[str]] = {"expected": Counter(), "unexplained": Counter()}
    examples: dict[str, str] = {}
    sources = [("server", out / "server.log")] + [("client", p) for p in sorted(out.glob("worker-*.log"))]
    for who, path in sources:
        objs, other = _json_lines(path)
        for o in objs:
            level = str(o.get("level", "")).lower()
            if level not in ("warning", "error", "critical"):
                continue
            name = str(o.get("event", "?"))
            key = f"{who} {level} {name}"
            after_kill = (who, name) in AFTER_KILL and AFTER_KILL[who, name] in str(o.get("reason", "")) and \
                "timestamp" in o and any(-1.0 <= _stamp(o) - k <= AFTER_KILL_S for k in kills)  # 1 s: notes' lag
            after_stop = (who, name) in AFTER_STOP and stop is not None and "timestamp" in o and _stamp(o) >= stop
            kind = "expected" if (who, name) in EXPECTED or after_kill or after_stop else "unexplained"
            found[kind][key] += 1
            examples.setdefault(key, json.dumps(o)[:400])
        for line in other:
            if who == "client" and _WORKER_END in line and line.startswith("host "):
                continue  # the worker's own summary line when it stops
            key = f"{who} text {line[:60]}"
            found["unexplained"][key] += 1
            examples.setdefault(key, line[:400])
    return {"expected": dict(found["expected"]), "unexplained": dict(found["unexplained"]), "examples": examples}


def read_samples(out: Path) -> list[dict[str, Any]]:
    """``samples.jsonl``, each row with its asyncio tasks per client alive (None where either is missing)."""
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip()]
    for r in rows:
        tasks, alive = r.get("asyncio_tasks"), r.get("clients_alive")
        r["tasks_per_client"] = tasks / alive if tasks is not None and alive else None
    return rows


def analyse(out: Path) -> dict[str, Any]:
    samples = read_samples(out)
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]
    server_events, _ = _json_lines(out / "server.log")
    rows = [json.loads(x) for x in (out / "run" / "rounds.jsonl").read_text().splitlines() if x.strip()]
    numbers = [int(r["round"]) for r in rows]
    contiguous = numbers == list(range(1, len(numbers) + 1))
    kill = next((e for e in events if e["kind"] == "server_killed"), None)
    end_min = max(s["t_min"] for s in samples)
    segments = [(0.0, kill["t_min"]), (kill["t_min"], end_min)] if kill else [(0.0, end_min)]
    drifts = [drift(samples, a, b) for a, b in segments]
    resumed = [e for e in server_events if e.get("event") == "federation.resumed"]
    stop = next((e for e in events if e["kind"] == "stopping"), None)
    stop_time = stop["time"] if stop else None
    # Attempts abandoned before the soak's end (the round is re-run with the next attempt); at the end every client
    # leaves, so the round in flight then is abandoned by design.
    abandoned = [e for e in server_events if e.get("event") == "round.abandoned"
                 and (stop_time is None or _stamp(e) < stop_time)]
    started = {int(e["round"]) for e in server_events if e.get("event") == "round.started"}
    completed = {int(e["round"]) for e in server_events if e.get("event") == "round.completed"}
    killed_round = int(resumed[0]["completed_rounds"]) + 1 if resumed else None
    # A round the server started and never completed (the one in flight at the final stop aside).
    never = sorted(started - completed - {max(started, default=0)})
    kill_time = kill.get("signalled", kill["time"]) if kill else None  # the SIGKILL's moment
    first_after = None
    if kill_time is not None:
        after = [e for e in server_events if e.get("event") == "round.completed" and _stamp(e) > kill_time]
        first_after = _stamp(after[0]) - kill_time if after else None
    span = [e["time"] for e in events if e["kind"] == "minute_0"] + ([stop["time"]] if stop else [])
    in_span = [e for e in server_events if e.get("event") == "round.completed" and span and
               span[0] <= _stamp(e) <= span[-1]]
    churns = [e for e in events if e["kind"] == "churn"]
    logs = scan_logs(out, [kill_time] if kill_time else [], stop_time)
    worst = max((abs(x) for d in drifts for m in METRICS if (x := d[m]["drift_pct"]) is not None), default=None)
    return {
        "samples": len(samples), "segments": segments, "drift": drifts, "worst_drift_pct": worst,
        "server_pids": sorted({s["pid"] for s in samples}), "restarts": len(resumed),
        "rounds_rows": len(rows), "rounds_contiguous": contiguous, "rounds_in_soak": len(in_span),
        "killed_round": killed_round, "abandoned_attempts": len(abandoned),
        "started_never_completed": never,
        "rounds_lost_beyond_killed": len(abandoned) + len(never) + (0 if contiguous else 1),
        "first_round_after_kill_s": first_after, "churn_events": len(churns), "logs": logs,
        "minutes": end_min,
    }


def plot(out: Path, summary: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = read_samples(out)
    fig, axes = plt.subplots(5, 1, figsize=(9, 11), sharex=True)
    pids = sorted({s["pid"] for s in samples}, key=lambda p: min(s["t_min"] for s in samples if s["pid"] == p))
    colors = ["tab:blue", "tab:orange", "tab:green"]
    for ax, m in zip(axes, (*METRICS, "clients_alive"), strict=True):
        for pid, color in zip(pids, colors, strict=False):
            pts = [(s["t_min"], s[m]) for s in samples if s["pid"] == pid and s.get(m) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", color=color, linewidth=1.0,
                    label=f"server pid {pid}")
        for a, b in summary["segments"]:
            length = b - a
            ax.axvspan(a + length / 6, a + length / 3, color="grey", alpha=0.15)
            ax.axvspan(b - length / 6, b, color="grey", alpha=0.15)
        if len(summary["segments"]) > 1:
            ax.axvline(summary["segments"][1][0], color="red", linestyle="--", linewidth=1.0)
        ax.set_ylabel(LABELS.get(m, "clients alive"))
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    axes[-1].set_xlabel("minutes since the first round (red: server SIGKILL and restart; grey: compared windows)")
    fig.suptitle("fedserver over a soak: churn, stragglers, a kill -9 and resume")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    def fmt(v: float | None, nd: int = 1) -> str:
        return "–" if v is None else f"{v:,.{nd}f}"

    lines = ["| metric | " + " | ".join(
        f"process {i + 1}: min {a + (b - a) / 6:.1f}–{a + (b - a) / 3:.1f} → {b - (b - a) / 6:.1f}–{b:.1f}"
        for i, (a, b) in enumerate(summary["segments"])) + " |",
        "| --- |" + " --- |" * len(summary["segments"])]
    for m in (*METRICS, *EXTRA):
        nd = 3 if m == "tasks_per_client" else 1
        cells = [f"{fmt(d[m]['early'], nd)} → {fmt(d[m]['late'], nd)} ({fmt(d[m]['drift_pct'], 2)} %)"
                 for d in summary["drift"]]
        lines.append(f"| {LABELS[m]}{'' if m in METRICS else ' (not in the goal)'} | " + " | ".join(cells) + " |")
    logs = summary["logs"]
    lines += [
        "",
        f"- samples: {summary['samples']} (every {args.sample_s:g} s); worst drift "
        f"{fmt(summary['worst_drift_pct'], 2)} % (goal ≤ {GOAL_DRIFT_PCT:g} %: "
        f"{'met' if (summary['worst_drift_pct'] or 0) <= GOAL_DRIFT_PCT else 'missed'})",
        f"- rounds: {summary['rounds_rows']} rows in rounds.jsonl (contiguous: {summary['rounds_contiguous']}), "
        f"{summary['rounds_in_soak']} completed in the measured {summary['minutes']:.1f} min; round in flight at "
        f"the kill: {summary['killed_round']} (re-run), first round after the kill "
        f"{fmt(summary['first_round_after_kill_s'])} s later; rounds lost beyond it: "
        f"{summary['rounds_lost_beyond_killed']} (abandoned attempts {summary['abandoned_attempts']}, started and "
        f"never completed {summary['started_never_completed']})",
        f"- churn: {summary['churn_events']} worker restarts; server processes {len(summary['server_pids'])}",
        "- warnings/errors expected from the injected faults: "
        + (", ".join(f"{k} ×{v}" for k, v in sorted(logs["expected"].items())) or "none"),
        "- warnings/errors not explained by an injected fault: "
        + (", ".join(f"{k} ×{v}" for k, v in sorted(logs["unexplained"].items())) or "none"),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="length of the measured soak (after the first round)")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("-k", type=int, default=100, help="clients per round")
    ap.add_argument("--procs", type=int, default=10, help="worker processes hosting the virtual clients")
    ap.add_argument("--kill-at", type=float, default=30.0, help="minute of the server's SIGKILL and restart")
    ap.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples of the server")
    ap.add_argument("--churn", type=float, default=0.1, help="fraction of the clients leaving and rejoining")
    ap.add_argument("--churn-every", type=float, default=60.0, help="seconds between churns")
    ap.add_argument("--stragglers", type=float, default=0.1, help="fraction of the clients that straggle")
    ap.add_argument("--straggler-delay", type=float, default=2.0, help="median straggler delay (lognormal), s")
    ap.add_argument("--round-timeout", type=float, default=60.0)
    ap.add_argument("--trainer", default="noop")
    ap.add_argument("--backoff-max", type=float, default=10.0, help="the clients' longest retry back-off, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for the first round")
    ap.add_argument("--out", type=Path, required=True, help="a new or empty directory for everything the soak keeps")
    ap.add_argument("--analyse-only", action="store_true", help="re-run the analysis of an existing --out")
    args = ap.parse_args(argv)
    if not 0 <= args.churn <= 1 or not 0 <= args.stragglers <= 1:
        ap.error("--churn and --stragglers are fractions in [0, 1]")
    if not 0 < args.kill_at < args.minutes:
        ap.error("--kill-at must fall inside the soak")
    out: Path = args.out.resolve()
    if not args.analyse_only:
        if out.exists() and any(out.iterdir()):
            ap.error(f"--out {out}: not empty (name a new directory)")
        out.mkdir(parents=True, exist_ok=True)
        soak = Soak(args, out)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        try:
            soak.run()
        finally:
            soak.stop_all()
            (out / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in soak.events))
            (out / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=1))
    summary = analyse(out)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    md = markdown(summary, args)
    (out / "soak.md").write_text(md)
    try:
        plot(out, summary, out / "soak.png")
    except ImportError:
        print("soak: matplotlib is not installed: no plot", file=sys.stderr)
    print(md)
    print(f"kept in {out} (samples.jsonl, summary.json, soak.md, soak.png, the logs and the run dir)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
