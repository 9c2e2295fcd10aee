"""Framework overhead per round: fedserver + K fedclient processes on loopback with a no-op trainer.

Clients return the received model at once, so what is left is the protocol: long-poll hand-out of the
model in chunks, upload stream, validation, FedAvg, state-machine steps, logging. Reports the median
server-side seconds per round (round start -> aggregated), the wall-clock seconds between consecutive
round completions, and the memory of the server and of each client process: peak RSS (ru_maxrss from wait4)
and peak private memory (RssAnon from /proc/PID/status, sampled every 20 ms). RSS counts the pages of shared
libraries too (libtorch alone maps hundreds of MB that every process shares through the page cache); the
private part is what each extra process really costs.

    python tools/bench/bench_rounds.py                     # K = 10, 20 timed rounds, synthetic MLP
    python tools/bench/bench_rounds.py --hidden 1024 512   # a ~0.6M-parameter MLP instead
    python tools/bench/bench_rounds.py --virtual           # the K clients as threads of one process
    python tools/bench/bench_rounds.py --event-loop asyncio   # the server on the standard loop (default: uvloop)
    python tools/bench/bench_rounds.py --clients 1000 -k 100 --virtual --procs 10 --rounds 10   # a fleet (issue 13)
    python tools/bench/bench_rounds.py ... --cpu-breakdown cpu.json   # the server's CPU per function, per client-round
    python tools/bench/bench_rounds.py ... --profile server.prof   # where the server's time goes (cProfile: top 25
                                                              # of fedguard's functions, top 12 by internal time)

Where a round's time goes: the server writes each round's critical path into its ``rounds.jsonl`` row
(``timing_seconds``, fedserver.round_timing: selection, task hand-out, client turnaround, upload, aggregation,
snapshot, report; the round and the server's CPU seconds over it); the benchmark prints the median of each phase
over the timed rounds, its share of the median round, and the server CPU per client-round.

The end of the federation: how many clients acknowledged "finished" with their Leave before the server stopped, and
how long after the last round it stopped (``federation.linger_ended`` if its linger ran out). ``--keep-logs DIR``
keeps the server's and the hosts' logs and the run dir.

With ``--clients N`` larger than K, the fleet is N connected clients of which K are selected per round (the
rest stay parked in their long-polls); the server's CPU seconds per round (user + system, sampled from /proc
between the first and the last timed round's completion) is the figure to watch on a small machine, where the
clients' threads share the same cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from tools.bench.spy_profile import Recorder, py_spy, summarize, watch  # noqa: E402
from tools.procstat import cpu_seconds, free_port, rss_anon_mib  # noqa: E402


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float,
             cpu_trace: list[tuple[float, float, float]] | None = None) -> list[tuple[int, float, float, float]]:
    """Wait for every process; (exit code, peak RSS MiB from wait4, peak RssAnon MiB sampled, CPU seconds user +
    system from wait4) of each. ``cpu_trace`` collects (wall time, CPU seconds of the first process, CPU seconds of
    the others together) samples while every process runs."""
    deadline = time.monotonic() + timeout
    results: dict[int, tuple[int, float, float]] = {}
    anon = dict.fromkeys(range(len(procs)), 0.0)
    while len(results) < len(procs):
        if cpu_trace is not None and not results:
            cpus = [cpu_seconds(p.pid) for p in procs]
            if all(c is not None for c in cpus):
                cpu_trace.append((time.time(), cpus[0] or 0.0, sum(c or 0.0 for c in cpus[1:])))
        for i, p in enumerate(procs):
            if i in results:
                continue
            a = rss_anon_mib(p.pid)
            if a is not None:
                anon[i] = max(anon[i], a)
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid == p.pid:
                p.returncode = os.waitstatus_to_exitcode(status)
                results[i] = (p.returncode, usage.ru_maxrss / 1024.0, usage.ru_utime + usage.ru_stime)
        if time.monotonic() > deadline:
            for i, p in enumerate(procs):
                if i not in results:
                    p.kill()
            raise TimeoutError("benchmark processes did not finish")
        time.sleep(0.02)
    return [(results[i][0], results[i][1], anon[i], results[i][2]) for i in range(len(procs))]


@contextlib.contextmanager
def _reaper() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list for the processes the benchmark starts; whichever still runs when the block ends is killed."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
                p.wait()


def _count_in(path: Path, needle: bytes) -> int:
    try:
        return path.read_bytes().count(needle)
    except OSError:
        return 0


def idle_report(server: subprocess.Popen[bytes], log: Path, n: int, seconds: float,
                hosts: list[subprocess.Popen[bytes]]) -> None:
    """Wait until ``n`` clients have joined (the server log's ``client.joined`` lines) and their first polls are
    parked, then print how long the joins took, the server's CPU over ``seconds`` with them all connected and idle,
    its memory, and the client hosts' private memory per virtual client."""
    t0 = progress = time.monotonic()
    last = 0
    while (joined := _count_in(log, b'"event": "client.joined"')) < n:
        if server.poll() is not None or any(h.poll() not in (None, 0) for h in hosts):
            raise RuntimeError(f"a process ended while {joined} of {n} clients had joined")
        if joined > last:
            last, progress = joined, time.monotonic()
        elif time.monotonic() - progress > 120:  # some clients failed for good (their hosts' logs say why)
            raise TimeoutError(f"{joined} of {n} clients joined; none more in 120 s")
        time.sleep(0.2)
    joins = time.monotonic() - t0
    print(f"{n:,} clients joined in {joins:.1f} s (host processes started -> the last client.joined; includes "
          f"their start-up and building each client's data and model)")
    time.sleep(min(5.0, max(1.0, seconds / 4)))  # the last joiners' first polls park
    cpu0, w0 = cpu_seconds(server.pid), time.monotonic()
    time.sleep(seconds)
    cpu1, w1 = cpu_seconds(server.pid), time.monotonic()
    if cpu0 is not None and cpu1 is not None:
        share = (cpu1 - cpu0) / (w1 - w0)
        print(f"idle server with {n:,} clients connected (each holding a long-poll): {100 * share:.1f}% of a core "
              f"({1e6 * share / n:.2f} µs of CPU per connected client per second) over {w1 - w0:.0f} s")
    anon = rss_anon_mib(server.pid)
    print(f"server private memory (RssAnon) with {n:,} connected: {anon:.0f} MiB")
    per_host = [(rss_anon_mib(h.pid) or 0.0) for h in hosts]
    print(f"client hosts' private memory (RssAnon): {sum(per_host):.0f} MiB in {len(hosts)} processes, "
          f"{1024 * sum(per_host) / n:.0f} KiB per virtual client (each process's own imports included)")


def keep_logs(tmp: Path, dest: Path) -> None:
    """Copy the run's logs, host specs and run dir from ``tmp`` into ``dest`` (``main`` refuses a ``dest`` that
    is not empty before the run starts: nothing in it is replaced)."""
    shutil.copytree(tmp, dest, dirs_exist_ok=True)
    print(f"logs kept in {dest}", file=sys.stderr)


def print_end(events: list[dict[str, Any]], n: int) -> None:
    """The federation's end (the server log): how many of the ``n`` clients acknowledged "finished" with their Leave
    before the server stopped, how long that took, and the server's ``federation.linger_ended`` if its linger ran out
    (docs/protocol.md, "The end of a federation")."""
    finished = next((e for e in events if e["event"] == "federation.finished"), None)
    stopped = next((e for e in events if e["event"] == "server.stopped"), None)
    if finished is None or stopped is None:
        print("the end: no federation.finished / server.stopped in the server log")
        return
    after = False
    left = 0
    for e in events:
        after = after or e is finished
        left += after and e["event"] == "client.left"
    ended = next((e for e in events if e["event"] == "federation.linger_ended"), None)
    lost = (f"the linger ran out: {ended['told_not_left']} told but not left, {ended['never_told']} never told"
            if ended else "no client lost")
    print(f"the end: {left:,} of {n:,} clients left after the last round; the server stopped "
          f"{_stamp(stopped) - _stamp(finished):.1f} s after federation.finished ({lost})")


def print_phases(rows: list[dict[str, Any]], k: int) -> None:
    """The median of each phase of the rounds' critical path (their rows' ``timing_seconds``), its share of the
    median round, and the server CPU per client-round."""
    from fedserver.round_timing import PHASES

    timed = [r for r in rows if "timing_seconds" in r]
    timings = [r["timing_seconds"] for r in timed]
    if not timings:
        print("no timing_seconds in rounds.jsonl (a server before issue 30)")
        return
    whole = statistics.median(t["round"] for t in timings)
    print(f"where a round's time goes (median over {len(timings)} rounds' critical path; share of the median "
          f"round {whole:.4f} s):")
    print(f"  {'phase':<12} {'median s':>9} {'share':>6}   {'min':>8} {'max':>8}")
    for name in (*PHASES, "round"):
        values = [t[name] for t in timings]
        med = statistics.median(values)
        print(f"  {name:<12} {med:9.5f} {100 * med / whole if whole else 0.0:5.1f}%   {min(values):8.5f} "
              f"{max(values):8.5f}")
    rest = whole - sum(statistics.median(t[p] for t in timings) for p in PHASES)
    print(f"  (round minus the phases' medians: {rest:.5f} s: waits off the critical path, the medians' mismatch)")
    per_client = [t["server_cpu"] / max(1, r["selected"]) for t, r in zip(timings, timed, strict=True)]
    print(f"server CPU per client-round (the round's CPU seconds / selected, K = {k}): median "
          f"{1000 * statistics.median(per_client):.3f} ms (min {1000 * min(per_client):.3f}, "
          f"max {1000 * max(per_client):.3f})")


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def print_arrivals(rows: list[dict[str, Any]]) -> None:
    """How the K accepted updates spread over a round: the first, median and last acceptance after the round's start
    (the rows' ``timing_seconds``: ``first_update``, ``median_update``, and the critical path's hand-out, turnaround
    and upload for the last), medians over the rounds."""
    timings = [t for r in rows if "first_update" in (t := r.get("timing_seconds", {}))]
    if timings:
        first = statistics.median(t["first_update"] for t in timings)
        mid = statistics.median(t["median_update"] for t in timings)
        last = statistics.median(t["hand_out"] + t["turnaround"] + t["upload"] for t in timings)
        print(f"updates accepted after the round's start (rounds.jsonl; medians over rounds): first {first:.4f} s, "
              f"median {mid:.4f} s, last {last:.4f} s")


def client_sums(server_sums: Path) -> Path:
    """Where ``--cpu-breakdown FILE`` puts the first client's sums (K client processes only)."""
    return server_sums.with_name(server_sums.stem + ".client" + server_sums.suffix)


def print_cpu_breakdown(sums: dict[str, Any], count: int, who: str = "server", per: str = "client-round",
                        counted: str = "updates accepted") -> None:
    """``tools/bench/cpu_breakdown.py``'s sums over the whole run (start-up, joins and warm-up included) divided by
    ``count``: the accepted updates (the server's, per client-round) or the timed rounds (a client's: its warm-up
    round and start-up are in the sums too, so its figures are an upper bound)."""
    n = max(1, count)
    print(f"{who} CPU by function, measured in place over the whole run (tools/bench/cpu_breakdown.py; inclusive, "
          f"nested functions count in each), per {per} ({count:,} {counted}):")
    print(f"  process {sums['process_cpu_ns'] / n / 1000:.1f} µs, its main thread "
          f"{sums['main_thread_cpu_ns'] / n / 1000:.1f} µs (start-up included)")
    print(f"  {'function':<36} {'µs/round':>9} {'calls':>6} {'µs/call':>8}")
    for name, f in sums["functions"].items():
        if f["calls"]:
            print(f"  {name:<36} {f['cpu_ns'] / n / 1000:9.1f} {f['calls'] / n:6.2f} "
                  f"{f['cpu_ns'] / f['calls'] / 1000:8.1f}")


def rows_in(path: Path) -> int:
    """Rows of ``rounds.jsonl`` so far (0 before it exists)."""
    try:
        return sum(1 for line in path.read_bytes().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def _pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` that restricts the child to ``cpus`` (None: no restriction)."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (after the --warmup rounds)")
    ap.add_argument("--warmup", type=int, default=1, metavar="N",
                    help="untimed rounds first (default 1); a fleet's steady state, where every client holds its "
                         "Session stream, needs each client answered once (about N ln N / K rounds, or one "
                         "long-poll)")
    ap.add_argument("--hidden", type=int, nargs="*", default=[64], help="MLP hidden widths")
    ap.add_argument("--virtual", action="store_true", help="clients as threads of one process")
    ap.add_argument("--clients", type=int, default=0, help="fleet size N (default K): N - K stay idle each round")
    ap.add_argument("--procs", type=int, default=1, help="--virtual: client processes the fleet is spread over")
    ap.add_argument("--profile", metavar="FILE", help="run the server under cProfile, save FILE, print the top 25")
    ap.add_argument("--cpu-breakdown", metavar="FILE", type=Path,
                    help="run the server under tools/bench/cpu_breakdown.py (each of a few functions' thread CPU, "
                         "measured in place), save the sums in FILE and print them per client-round")
    ap.add_argument("--idle", type=float, default=0.0, metavar="S",
                    help="hold the fleet's last client back: once the other N - 1 have joined and parked their "
                         "long-polls, report how long the joins took and the server's CPU over S seconds with "
                         "them all connected and idle, then let it join and run the rounds")
    ap.add_argument("--long-poll", type=float, default=0.0, metavar="S",
                    help="--virtual: server.long_poll_s and the clients' long_poll_s (default: the defaults, 20 s); "
                         "an idle client re-polls once per S seconds")
    ap.add_argument("--transport", choices=["session", "framed", "unary"], default="session",
                    help="how clients pull and push: one gRPC Session stream each (the default), the same stream on "
                         "the server's framed port (server.framed_address, fedguard/framing.py), or the unary "
                         "PullTask and PushUpdate calls (client session_stream = false)")
    ap.add_argument("--tls", action="store_true",
                    help="mutual TLS with a throw-away CA (fedlaunch.credentials.make_tls_dir) instead of plaintext; "
                         "K client processes only (not --virtual)")
    ap.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                    help="the server's event loop (server.event_loop; auto: uvloop where installed)")
    ap.add_argument("--py-spy", metavar="FILE", type=Path,
                    help="sample the server with py-spy (--gil: only while it holds the GIL) over the timed rounds, "
                         "keep the raw samples in FILE and print where they fall (tools/bench/spy_profile.py; needs "
                         "py-spy installed and ptrace rights over the server)")
    ap.add_argument("--py-spy-native", action="store_true",
                    help="with --py-spy: sample the C frames too (py-spy --native) and say which libraries and "
                         "system calls the server's GIL-held time is in (each sample stops the server: shares only)")
    ap.add_argument("--pin-server", action="store_true",
                    help="run the server on one CPU of its own and every client process on the others (Linux "
                         "affinity): the coordinator's cost as on a machine of its own, not inflated by the client "
                         "simulator sharing its core (compare against a run without it)")
    ap.add_argument("--keep-logs", metavar="DIR", type=Path,
                    help="copy the server's and the client hosts' logs and the run dir into DIR when the run "
                         "ends (a failed fleet run's evidence; by default they go with the temporary directory)")
    args = ap.parse_args()
    if args.profile and args.cpu_breakdown is not None:
        ap.error("--profile and --cpu-breakdown each run the server under their own wrapper: choose one")
    if args.profile and args.py_spy is not None:
        ap.error("--profile slows the server it samples: --py-spy measures the server without it")
    if args.py_spy_native and args.py_spy is None:
        ap.error("--py-spy-native goes with --py-spy FILE")
    if args.py_spy is not None:
        py_spy()  # missing: says so before anything starts
    if args.warmup < 1:
        ap.error("--warmup must be >= 1 (the first round's start-up is not a round's cost)")
    if args.tls and args.virtual:
        ap.error("--tls runs K client processes, each with its certificate: not with --virtual")
    n = args.clients or args.k
    if args.keep_logs is not None and args.keep_logs.exists() and any(args.keep_logs.iterdir()):
        ap.error(f"--keep-logs {args.keep_logs}: not empty (nothing in it is replaced; name a new directory)")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    server_cpus: set[int] | None = None
    client_cpus: set[int] | None = None
    if args.pin_server:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(cpus) < 2:
            ap.error(f"--pin-server needs Linux CPU affinity and at least 2 CPUs, this process may use {len(cpus)}")
        server_cpus, client_cpus = {cpus[0]}, set(cpus[1:])
        print(f"server on CPU {cpus[0]}, client processes on CPU(s) {','.join(map(str, cpus[1:]))}")
    # SIGTERM (a timeout, a CI runner) ends the benchmark like ^C: the processes it started are killed, not
    # orphaned (10,000 orphaned virtual clients retry a vanished server for minutes).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with TemporaryDirectory() as tmp, _reaper() as started:
        run_dir = Path(tmp) / "run"
        address = f"127.0.0.1:{free_port()}"
        from fedlaunch.credentials import client_tls_flags, make_tls_dir, server_tls_flags

        tls_dir = make_tls_dir([f"bench-{i}" for i in range(n)], Path(tmp) / "tls") if args.tls else None
        total = args.rounds + args.warmup
        serve = ["-m", "cProfile", "-o", str(Path(args.profile).resolve()), "-m", "fedserver"] if args.profile \
            else ["-m", "fedserver"]
        if args.cpu_breakdown is not None:
            serve = ["-m", "tools.bench.cpu_breakdown", str(args.cpu_breakdown.resolve()), "--"]
        server = subprocess.Popen(
            [py, *serve, "--address", address, "--rounds", str(total), "-k", str(args.k),
             "--run-dir", str(run_dir), "--log-json", "--log-level", "info", "--event-loop", args.event_loop,
             # Long enough for every client to hear that the federation finished and leave (10,000 at once).
             "--linger", str(max(10, n // 400)),
             *(["--set", f"server.long_poll_s={args.long_poll}"] if args.long_poll else []),
             "--framed-address", "127.0.0.1:0" if args.transport == "framed" else "",
             "--min-available", str(n), "--model-kwargs", json.dumps({"hidden": args.hidden}),
             *server_tls_flags(tls_dir)],
            stdout=open(Path(tmp) / "server.log", "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
            preexec_fn=_pinned(server_cpus))
        if args.virtual:
            held = 1 if args.idle > 0 else 0
            poll: dict[str, Any] = {"long_poll_s": args.long_poll} if args.long_poll else {}
            poll["session_stream"] = args.transport != "unary"
            per = -(-(n - held) // args.procs)
            from fedlaunch.hosts import HostSpec, worker_command

            cmds = [worker_command(HostSpec(address, first, min(per, n - held - first), trainer="noop", **poll),
                                   Path(tmp) / f"host-{first}.json") for first in range(0, n - held, per)]
            if held:  # the held-back client, a host of its own
                cmds.append(worker_command(HostSpec(address, n - 1, 1, trainer="noop", **poll),
                                           Path(tmp) / "host-last.json"))
        else:
            cmds = [[py, "-m", "fedclient", "--server", address, "--client-id", f"bench-{i}", "--data-index",
                     str(i), "--trainer", "noop", "--torch-threads", "1", "--log-level", "warning",
                     *client_tls_flags(tls_dir, f"bench-{i}"),
                     "--set", f"session_stream={str(args.transport != 'unary').lower()}"]
                    for i in range(n)]
            if args.cpu_breakdown is not None:  # the first client too, beside the server
                cmds[0][1:3] = ["-m", "tools.bench.cpu_breakdown", str(client_sums(args.cpu_breakdown)), "--client",
                                "--"]
        client_logs = [Path(tmp) / f"clients-{i}.log" for i in range(len(cmds))]

        started.append(server)

        def launch(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
            started.append(subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env,  # noqa: SIM115
                                            preexec_fn=_pinned(client_cpus)))
            return started[-1]

        if args.idle > 0:
            if not args.virtual:
                ap.error("--idle needs --virtual")
            clients = [launch(c, log) for c, log in zip(cmds[:-1], client_logs[:-1], strict=True)]
            try:
                idle_report(server, Path(tmp) / "server.log", n - 1, args.idle, clients)
            except BaseException:
                for p in (server, *clients):
                    p.kill()
                    p.wait()
                for log in client_logs[:-1]:
                    failed = [x for x in log.read_text().splitlines() if '"client.failed"' in x]
                    if failed:
                        print(f"{log.name}: {len(failed)} clients failed, e.g. {failed[0][:300]}", file=sys.stderr)
                raise
            clients.append(launch(cmds[-1], client_logs[-1]))
        else:
            clients = [launch(c, log) for c, log in zip(cmds, client_logs, strict=True)]
        trace: list[tuple[float, float, float]] = []
        ended = threading.Event()
        spy = Recorder(server.pid, args.py_spy.resolve(), native=args.py_spy_native) \
            if args.py_spy is not None else None
        if spy is not None:
            watch(spy, lambda: rows_in(run_dir / "rounds.jsonl"), args.warmup, total, ended)
        try:
            (rc, server_rss, server_anon, _), *client_res = wait_all([server, *clients], 900, trace)
        finally:
            ended.set()
        spy_says = spy.stop() if spy is not None else ""
        events = [json.loads(line) for line in (Path(tmp) / "server.log").read_text().splitlines()
                  if line.startswith("{")]
        rows = [json.loads(line) for line in (run_dir / "rounds.jsonl").read_text().splitlines() if line.strip()]
        failed_tails = [log.read_text().splitlines()[-25:] for log, (code, *_) in zip(client_logs, client_res,
                                                                                      strict=True) if code != 0]
        if args.keep_logs is not None:
            keep_logs(Path(tmp), args.keep_logs)
    if rc != 0 or any(code != 0 for code, _, _, _ in client_res):
        print(f"benchmark run failed: server {rc}, clients {[c for c, _, _, _ in client_res]}", file=sys.stderr)
        for tail in failed_tails[:3]:
            print("  " + "\n  ".join(tail), file=sys.stderr)
        return 1
    done = [e for e in events if e["event"] == "round.completed"]
    assert len(done) == total, len(done)
    timed = done[args.warmup:]
    per_round = [e["seconds"] for e in timed]
    stamps = [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
              for e in done[args.warmup - 1:]]
    wall = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    start = next(e for e in events if e["event"] == "federation.started")
    loop = next(e for e in events if e["event"] == "server.listening").get("event_loop", "asyncio")
    rss = [r for _, r, _, _ in client_res]
    anon = [a for _, _, a, _ in client_res]
    layout = f"threads of {len(client_res)} process(es)" if args.virtual else "one process each"
    via = {"session": "a Session stream each", "framed": "a Session stream each on the framed port",
           "unary": "unary PullTask/PushUpdate calls"}[args.transport]
    print(f"K = {args.k} of N = {n} clients ({layout}; {via}), no-op trainer, {start['params']:,}-parameter MLP, "
          f"{args.rounds} timed rounds after {args.warmup} warm-up; server event loop: {loop}")
    print(f"median seconds per round (start -> aggregated): {statistics.median(per_round):.4f}  "
          f"(min {min(per_round):.4f}, max {max(per_round):.4f})")
    print(f"wall seconds per round (between completions):   {wall:.4f}")
    def cpu_at(t: float) -> tuple[float, float, float]:
        return min(trace, key=lambda sample: abs(sample[0] - t))

    server_cpu = (cpu_at(stamps[-1])[1] - cpu_at(stamps[0])[1]) / (len(stamps) - 1)
    clients_cpu = (cpu_at(stamps[-1])[2] - cpu_at(stamps[0])[2]) / (len(stamps) - 1)
    print(f"server CPU seconds per round (user + system, between completions): {server_cpu:.4f} "
          f"({1000 * server_cpu / args.k:.3f} ms per client-round)")
    print(f"client processes' CPU seconds per round (all of them, same span): {clients_cpu:.4f} "
          f"({1000 * clients_cpu / args.k:.3f} ms per client-round); with the server's: "
          f"{1000 * (server_cpu + clients_cpu):.1f} ms of CPU per round on {os.cpu_count()} cores")
    print(f"peak RSS server: {server_rss:.0f} MiB; client process: median {statistics.median(rss):.0f} MiB, "
          f"max {max(rss):.0f} MiB")
    print(f"peak private (RssAnon) server: {server_anon:.0f} MiB; client process: median "
          f"{statistics.median(anon):.0f} MiB, max {max(anon):.0f} MiB")
    print_phases(rows[args.warmup:], args.k)
    print_arrivals(rows[args.warmup:])
    print_end(events, n)
    if args.cpu_breakdown is not None:
        print_cpu_breakdown(json.loads(args.cpu_breakdown.read_text()), sum(int(r["accepted"]) for r in rows))
        if not args.virtual:
            print_cpu_breakdown(json.loads(client_sums(args.cpu_breakdown).read_text()), len(rows) - args.warmup,
                                who="client bench-0", per="round", counted="timed rounds; its start-up and warm-up "
                                                                           "are in the sums")
    if args.py_spy is not None:
        print(f"server sampled by py-spy over the timed rounds ({args.py_spy}):")
        if not args.pin_server:
            print("  (the server shares its cores with the clients: a sample also counts the time the GIL's holder "
                  "waited preempted; --pin-server gives shares of its CPU)")
        print("  " + "\n  ".join([spy_says] if spy_says else summarize(args.py_spy)))
    if args.profile:
        import pstats

        # The whole process's top entries are start-up (imports) and the event loop; the serving code's are
        # fedguard's own functions (cumulative), and the C-level work (gRPC's Cython callbacks run inside
        # Context.run, epoll) shows by internal time.
        stats = pstats.Stats(args.profile)
        print(f"server profile ({args.profile}), fedguard's functions, top 25 by cumulative time:")
        own = rf"^{re.escape(str(root))}/(fedserver|fedcore|fedguard)/(?!.*\(<module>\)$)"  # not the imports
        stats.sort_stats("cumulative").print_stats(own, 25)
        print("top 12 by internal time (whole process):")
        stats.sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
