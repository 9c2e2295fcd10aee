"""Cost of the coordinator's durability (fedserver.store), one mode per subcommand.

  snapshot  StateStore.save of one completed round: every model (fedcore.serialization format, sha256 while
            writing) + one SQLite WAL commit of the coordinator's JSON state (round machine with --clients
            client records, the history of every round so far) + pruning beyond --keep. Timed over --rounds
            saves in a temp dir, with fsync off (survives kill -9) and on (survives a power cut); then the
            time of one StateStore.load (verifies sizes, sha256 and parses every model of the newest snapshot).

  growth    Does a snapshot's cost grow with the number of rounds? A live no-op federation (fedserver.ServerThread, -k
            no-op clients, the 4.5k-parameter mlp) of --rounds (default 1,000) rounds; Persistence.snapshot (what
            the coordinator runs after every round: round machine with the client registry, NFL detector state,
            the rounds' history, the model) timed in the server; prints the median snapshot time around round 10
            and around the last round, and their ratio (goal: within 1.5x).
  overhead  What persistence adds to a round of a live federation: K = -k no-op clients (threads of this process)
            and a fedserver.ServerThread, persistence.enabled on and off side by side in one run (--pairs
            federations per setting, alternating which goes first), each --rounds timed rounds after --warmup.
            A round's wall time is the time between consecutive round completions (the coordinator's
            subscribers, time.perf_counter); prints median and p90 per setting, their difference (goal: at most
            +5 ms per round for small models) and the snapshot's own time in the server (Persistence.snapshot
            in its worker thread, and StateStore.save within it: last_save_seconds = the logged snapshot_s).
            After each pair, one more federation whose rounds take or skip the snapshot in seeded random order
            (--mixed-rounds): the same comparison free of federation-to-federation drift; the verdict uses it.
  restart   Seconds from a server restart to the next completed round, with real processes: `python -m
            fedserver` and K clients (`fedguard-launch worker`, threads of one process; --processes: one
            `python -m fedclient` each) with a small reconnection backoff. The server is SIGKILLed mid-federation
            and the identical command line started again, --repeats times; from the restarted server's JSON log:
            exec -> state restored, -> listening, -> every client re-joined, -> next round completed.

    python tools/bench/bench_persistence.py snapshot
    python tools/bench/bench_persistence.py snapshot --models mlp --rounds 50 --clients 1000
    python tools/bench/bench_persistence.py growth                         # rounds 10 vs 1,000
    python tools/bench/bench_persistence.py growth --figures docs/figures.toml   # and update the figures file
    python tools/bench/bench_persistence.py overhead                       # mlp, K = 10, 5 federations per setting
    python tools/bench/bench_persistence.py overhead --models mlp cifar_cnn --fsync
    python tools/bench/bench_persistence.py restart                        # K = 10, 3 restarts
    python tools/bench/bench_persistence.py restart --processes --backoff-max 1
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import torch

from fedcore import rounds as rm
from fedcore.models import build_model
from fedcore.report import RoundReport
from fedserver.store import Snapshot, StateStore

MODELS = ("mlp", "cifar_cnn", "resnet18_cifar")
ROOT = Path(__file__).resolve().parents[2]
GOAL_MS = 5.0  # the budget: persistence may add at most this much to a round of a small model
# Datasets the overhead mode gives each model: no-op clients still evaluate the model they receive on their
# test split, so image models need image data; CIFAR-10 is read offline from the shared data folder.
OVERHEAD_DATA: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("synthetic", {}),
    "logreg": ("synthetic", {}),
    "cifar_cnn": ("cifar10", {"max_samples": 2000, "num_clients": 10}),
    "resnet18_cifar": ("cifar10", {"max_samples": 2000, "num_clients": 10}),
}


def _pct(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (nearest rank, as the snapshot mode's p90)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def coordinator_state(num_clients: int, completed_rounds: int) -> dict[str, Any]:
    """What fedserver.persistence snapshots: the round machine with its client registry and the history."""
    clients = {f"client-{i:04d}": rm.ClientRecord(client_id=f"client-{i:04d}", index=i, num_samples=500 + i,
                                                  last_seen=1.7e9 + i / 7, ready=True)
               for i in range(num_clients)}
    ids = sorted(clients)
    state = rm.RoundState(round=completed_rounds + 1, phase_since=1.7e9, deadline=1.7e9 + 60.0,
                          selected=ids[:10], accepted=ids[:8], rejected={ids[9]: "stale round"}, clients=clients)
    history = [RoundReport(round=r, selected=10, accepted=10, mean_train_loss=1.0 / r, mean_test_accuracy=0.5,
                           beta=0.1, seconds=1.5, outcome="quorum",
                           metrics={"num_updates": 10.0, "w_div": 0.01 * r, "delta": 0.2, "update_norm_mean": 1.1,
                                    "update_norm_max": 2.3})
               for r in range(1, completed_rounds + 1)]
    return {"round_state": state.to_saved(), "history": [h.to_dict() for h in history], "slots": {}}


def bench_snapshot(args: argparse.Namespace) -> None:
    print(f"StateStore.save: {args.rounds} rounds (+1 warm-up), {args.clients} clients in the state, "
          f"history grows by one report per round, keep={args.keep}; torch {torch.__version__}")
    header = (f"{'model':<16}{'params':>11}{'fsync':>7}{'model B/snap':>14}{'state B':>10}{'median s':>11}"
              f"{'p90 s':>11}{'load s':>10}")
    print(header)
    print("-" * len(header))
    for name in args.models:
        state_dict = {k: v.detach().clone() for k, v in build_model(name, {}, seed=0).state_dict().items()}
        params = sum(v.numel() for v in state_dict.values() if v.is_floating_point())
        for fsync in (False, True):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                store = StateStore(Path(tmp) / "state", keep=args.keep, fsync=fsync)
                times: list[float] = []
                model_bytes = state_bytes = 0
                for r in range(args.rounds + 1):
                    # A new model every round (as after aggregation): perturb one tensor in place.
                    first = next(iter(state_dict.values()))
                    if first.is_floating_point():
                        first.add_(1e-3)
                    snap = Snapshot(r, coordinator_state(args.clients, r), {"global": state_dict})
                    t0 = time.perf_counter()
                    stats = store.save(snap)
                    elapsed = time.perf_counter() - t0
                    if r > 0:
                        times.append(elapsed)
                        model_bytes, state_bytes = stats.model_bytes, stats.state_bytes
                store.close()
                store = StateStore(Path(tmp) / "state", keep=args.keep, fsync=fsync)
                t0 = time.perf_counter()
                loaded = store.load()
                load_s = time.perf_counter() - t0
                store.close()
                assert loaded.snapshot is not None and loaded.snapshot.completed_rounds == args.rounds
            times.sort()
            p90 = times[min(len(times) - 1, round(0.9 * (len(times) - 1)))]
            print(f"{name:<16}{params:>11,}{'on' if fsync else 'off':>7}{model_bytes:>14,}{state_bytes:>10,}"
                  f"{statistics.median(times):>11.5f}{p90:>11.5f}{load_s:>10.5f}")
    print("state B = the JSON of the last round (history included); median/p90 over the timed saves.")


# ---- growth: snapshot time at round 10 vs round 1,000 ----

def bench_growth(args: argparse.Namespace) -> None:
    args.warmup = 0
    t0 = time.perf_counter()
    trial = run_trial("mlp", "on", args.rounds, args)
    window = args.window
    print(f"no-op federation: mlp ({trial.params:,} parameters), K = {args.k} no-op clients, {args.rounds + 1} "
          f"rounds with persistence on in {time.perf_counter() - t0:.1f} s; Persistence.snapshot (round machine, "
          f"clients, NFL state, history, model) timed in the server, medians over {window} rounds")
    # Rounds 2, 3, ... (run_trial's first timed round is 2). CPU time of the snapshot's thread is what the
    # snapshot costs; wall time also counts whatever else the machine ran meanwhile.
    for what, calls in (("CPU", trial.snapshot_cpu), ("wall", trial.snapshot_call)):
        def around(last_round: int, calls: list[float] = calls) -> float:
            first = max(2, last_round - window + 1)
            return statistics.median(calls[first - 2:last_round - 1])

        early, late = around(10 + window // 2), around(args.rounds + 1)
        print(f"snapshot {what} time around round 10: {early * 1000:.3f} ms; around round {args.rounds + 1}: "
              f"{late * 1000:.3f} ms; ratio {late / early:.2f} (goal <= 1.5)")
        if what == "CPU" and args.figures is not None:
            update_figures(args.figures, {"snapshot_cpu_early": f"{early * 1000:.3f}",
                                          "snapshot_cpu_late": f"{late * 1000:.3f}"})


def update_figures(path: Path, values: dict[str, str]) -> None:
    """Write ``values`` (figure name -> value) into the figures file ``path`` (docs/figures.toml), dated today."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tools.dev import figures as figures_file

    for name, value in values.items():
        figures_file.update(path, name, value)
        print(f"{path}: {name} = {value}")


# ---- overhead: a live federation with persistence on vs off ----

@dataclass
class Trial:
    """One federation's timings (seconds). ``mode``: ``on``/``off`` = persistence.enabled; ``mixed`` = enabled,
    but a seeded random half of the timed rounds skip the snapshot (exactly what ``enabled = false`` does:
    Persistence.snapshot returns at once, still in its worker thread), so on and off rounds interleave."""

    mode: str
    params: int = 0
    # (the round's snapshot was taken, seconds since the previous round completed), timed rounds only
    intervals: list[tuple[bool, float]] = field(default_factory=list)
    round_seconds: list[tuple[bool, float]] = field(default_factory=list)  # RoundReport.seconds
    snapshot_call: list[float] = field(default_factory=list)  # Persistence.snapshot in its worker thread
    store_save: list[float] = field(default_factory=list)  # StateStore.save (last_save_seconds = snapshot_s)
    snapshot_cpu: list[float] = field(default_factory=list)  # the snapshot thread's CPU time (time.thread_time)


def run_trial(model: str, mode: str, rounds: int, args: argparse.Namespace, seed: int = 0) -> Trial:
    import random

    from fedclient import ClientConfig, FedClient
    from fedcore.config import ServerConfig, build_config
    from fedserver import ServerThread

    dataset, options = OVERHEAD_DATA[model]
    first_timed = args.warmup + 2  # its interval starts at the completion of round warmup + 1
    total = args.warmup + rounds + 1
    take = {r: mode != "off" for r in range(1, total + 1)}
    if mode == "mixed":  # each consecutive pair of timed rounds: one with the snapshot, one without, random order
        rng = random.Random(seed)
        for r in range(first_timed, total + 1, 2):
            flags = [True, False]
            rng.shuffle(flags)
            take[r] = flags[0]
            if r + 1 <= total:
                take[r + 1] = flags[1]
    trial = Trial(mode)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        overrides: list[tuple[list[str], Any]] = [
            (["server", "address"], "127.0.0.1:0"), (["server", "run_dir"], str(Path(tmp) / "run")),
            (["server", "log_level"], "warning"), (["rounds", "num_rounds"], total),
            (["rounds", "clients_per_round"], args.k), (["model", "name"], model), (["data", "dataset"], dataset),
            (["data", "options"], options), (["persistence", "enabled"], mode != "off"),
            (["persistence", "fsync"], args.fsync), (["security", "insecure"], True)]
        config = build_config(ServerConfig, None, overrides)
        srv = ServerThread(config, linger_s=0.5).start()
        done: list[tuple[int, float, float]] = []

        def hook() -> None:
            coord = srv.coordinator
            assert coord is not None
            trial.params = coord.models.num_params
            persistence = coord.persistence
            inner: Callable[..., None] = persistence.snapshot

            def timed_snapshot(*a: Any) -> None:
                round_ = int(a[2])
                if not take[round_]:
                    return
                t0, c0 = time.perf_counter(), time.thread_time()
                inner(*a)
                if round_ >= first_timed and persistence.store is not None:
                    trial.snapshot_call.append(time.perf_counter() - t0)
                    trial.snapshot_cpu.append(time.thread_time() - c0)
                    trial.store_save.append(persistence.last_save_seconds)

            setattr(persistence, "snapshot", timed_snapshot)  # noqa: B010 (an instance attribute, on purpose)
            coord.subscribe(lambda r: done.append((r.round, time.perf_counter(), r.seconds)))

        srv.call(hook)  # on the server's loop, before any client exists: no round can complete first
        clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                          trainer="noop", long_poll_s=5.0, torch_threads=1)).start()
                   for i in range(args.k)]
        status = srv.wait(300)
        for c in clients:
            c.join(30)
        if status is None or not status.finished or len(done) != total:
            raise SystemExit(f"overhead: federation did not finish ({len(done)}/{total} rounds): {status}")
    done.sort()
    for a, b in itertools.pairwise(done[first_timed - 2:]):
        trial.intervals.append((take[b[0]], b[1] - a[1]))
        trial.round_seconds.append((take[b[0]], b[2]))
    return trial


def _ms(trials: list[Trial], snapshot: bool, what: str = "intervals") -> list[float]:
    return [s * 1e3 for t in trials for flag, s in getattr(t, what) if flag == snapshot]


def _rows(name: str, params: int, design: str, trials: list[Trial]) -> tuple[float, float]:
    """Print an off and an on row; returns (median on − off, mean on − off) in ms."""
    stats: dict[bool, tuple[float, float, float, int, float]] = {}
    for snapshot in (False, True):
        iv = _ms(trials, snapshot)
        stats[snapshot] = (statistics.median(iv), _pct(iv, 0.9), statistics.fmean(iv), len(iv),
                           statistics.variance(iv) / len(iv))
        agg = _ms(trials, snapshot, "round_seconds")
        line = (f"{name:<9}{params:>10,}  {design:<12}{'on' if snapshot else 'off':>4}{len(iv):>7}"
                f"{stats[snapshot][0]:>10.2f}{stats[snapshot][1]:>8.2f}{stats[snapshot][2]:>9.2f}"
                f"{statistics.median(agg):>8.2f}")
        snap = [x * 1e3 for t in trials for x in t.snapshot_call]
        save = [x * 1e3 for t in trials for x in t.store_save]
        if snapshot and snap:
            line += f"{statistics.median(snap):>9.2f}{_pct(snap, 0.9):>9.2f}{statistics.median(save):>9.2f}"
        else:
            line += f"{'-':>9}{'-':>9}{'-':>9}"
        print(line)
    on, off = stats[True], stats[False]
    ci = 1.96 * (on[4] + off[4]) ** 0.5
    print(f"{'':<21}on − off: median {on[0] - off[0]:+.2f} ms, p90 {on[1] - off[1]:+.2f} ms, "
          f"mean {on[2] - off[2]:+.2f} ± {ci:.2f} ms (95 %, rounds taken as independent)")
    return on[0] - off[0], on[2] - off[2]


def bench_overhead(args: argparse.Namespace) -> None:
    from fedcore.log import configure_logging

    configure_logging(level="warning")
    for name in args.models:
        if name not in OVERHEAD_DATA:
            raise SystemExit(f"overhead: no dataset known for model {name!r}; choose from {sorted(OVERHEAD_DATA)}")
        dataset, options = OVERHEAD_DATA[name]
        if dataset != "synthetic":
            from fedcore.data import DataError, load_client_data

            try:
                load_client_data(dataset, 0, 0, options)
            except DataError as e:
                raise SystemExit(f"overhead: model {name} needs dataset {dataset}, not available offline: {e}") \
                    from None
    print(f"overhead: K = {args.k} no-op clients (threads of this process) + fedserver.ServerThread, "
          f"persistence.fsync={'on' if args.fsync else 'off'}; torch {torch.__version__}, 1 thread, "
          f"{os.cpu_count()} CPUs. Per model, in one run: {args.pairs} pairs of whole federations with "
          f"persistence.enabled off/on ({args.rounds} timed rounds after {args.warmup} warm-up each, the pair's "
          f"order alternating), and after each pair one federation ({args.mixed_rounds} timed rounds) whose "
          f"rounds take or skip the snapshot in seeded random order, one of each per two rounds.")
    header = (f"{'model':<9}{'params':>10}  {'design':<12}{'snap':>4}{'rounds':>7}{'median':>10}{'p90':>8}"
              f"{'mean':>9}{'agg':>8}{'snap':>9}{'snap p90':>9}{'save':>9}")
    print(header)
    print("-" * len(header))
    verdicts: list[str] = []
    for name in args.models:
        pairs: list[Trial] = []
        mixed: list[Trial] = []
        for pair in range(args.pairs):
            for mode in (("on", "off") if pair % 2 == 0 else ("off", "on")):
                pairs.append(run_trial(name, mode, args.rounds, args))
            mixed.append(run_trial(name, "mixed", args.mixed_rounds, args, seed=pair))
        params = pairs[0].params
        fed_median, _ = _rows(name, params, "federations", pairs)
        per_pair: list[float] = []
        for first, second in zip(pairs[::2], pairs[1::2], strict=True):
            on, off = (first, second) if first.mode == "on" else (second, first)
            per_pair.append(statistics.median(_ms([on], True)) - statistics.median(_ms([off], False)))
        print(f"{'':<21}per pair (median on − median off): {', '.join(f'{d:+.2f}' for d in per_pair)} ms")
        round_median, round_mean = _rows(name, params, "rounds", mixed)
        snap = statistics.median(x * 1e3 for t in pairs + mixed for x in t.snapshot_call)
        ok = round_median <= GOAL_MS
        verdicts.append(f"{name} ({params:,} parameters): persistence adds {round_median:+.2f} ms per round "
                        f"(median, rounds interleaved; mean {round_mean:+.2f} ms; whole federations: "
                        f"{fed_median:+.2f} ms); the snapshot the round waits for takes {snap:.2f} ms -> "
                        f"{'meets' if ok else 'MISSES'} the goal of at most +{GOAL_MS:.0f} ms per round")
    print("ms throughout. median/p90/mean = wall time between consecutive round completions (the coordinator's "
          "subscribers, time.perf_counter); agg = median RoundReport.seconds (round start -> aggregated, before "
          "the snapshot); snap = Persistence.snapshot (JSON body + StateStore.save, in the worker thread the "
          "round waits for); save = StateStore.save alone (the logged snapshot_s). 'federations' compares whole "
          "federations (persistence.enabled), 'rounds' the rounds of one federation; the verdict uses 'rounds' "
          "(federation-to-federation drift cancels out).")
    for v in verdicts:
        print(v)


# ---- restart: SIGKILL the server mid-federation, start the same command line, time the way back ----

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _events(log: Path) -> list[dict[str, Any]]:
    """The JSON lines of a server log so far (a torn last line is skipped)."""
    out: list[dict[str, Any]] = []
    try:
        text = log.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _wait_for(log: Path, proc: subprocess.Popen[bytes], test: Callable[[list[dict[str, Any]]], bool],
              timeout: float, what: str) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        events = _events(log)
        if test(events):
            return events
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n  ".join(log.read_text().splitlines()[-8:]) if log.exists() else ""
            state = "timed out" if proc.returncode is None else f"exited {proc.returncode}"
            raise SystemExit(f"restart: {what}: server {state}; log tail:\n  {tail}")
        time.sleep(0.005)


def _completed(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e.get("event") == "round.completed"]


@dataclass
class Restart:
    resumed_from: int
    restored: float  # exec -> federation.resumed (imports, config, StateStore.load, rm.resume)
    listening: float  # exec -> server.listening
    rejoined: float  # exec -> the K-th client re-joined
    round_started: float  # exec -> the re-run round started
    round_done: float  # exec -> that round completed
    round_no: int


def bench_restart(args: argparse.Namespace) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    address = f"127.0.0.1:{_free_port()}"
    results: list[Restart] = []
    t_begin = time.monotonic()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run_dir = Path(tmp) / "run"
        server_cmd = [py, "-m", "fedserver", "--address", address, "--run-dir", str(run_dir), "--rounds", "100000",
                      "-k", str(args.k), "--model", "mlp", "--dataset", "synthetic", "--log-json", "--log-level",
                      "info", "--linger", "0.5", "--insecure"]
        if args.fsync:
            server_cmd += ["--set", "persistence.fsync=true"]
        if args.processes:
            client_cmds = [[py, "-m", "fedclient", "--server", address, "--client-id", f"client-{i:05d}",
                            "--data-index", str(i), "--trainer", "noop", "--torch-threads", "1", "--log-level",
                            "warning", "--set", f"backoff_initial_s={args.backoff_initial}",
                            "--set", f"backoff_max_s={args.backoff_max}", "--insecure"] for i in range(args.k)]
            backoff = f"initial {args.backoff_initial} s, max {args.backoff_max} s"
        else:
            from fedlaunch.hosts import HostSpec, worker_command

            client_cmds = [worker_command(HostSpec(address, 0, args.k, trainer="noop", backoff_max=args.backoff_max),
                                          Path(tmp) / "host.json")]
            backoff = f"initial 0.2 s (ClientConfig default), max {args.backoff_max} s"
        print(f"restart: fedserver (mlp, synthetic, K = {args.k}, persistence.fsync="
              f"{'on' if args.fsync else 'off'}) + {args.k} no-op clients "
              f"({f'{args.k} fedclient processes' if args.processes else 'threads of one fedlaunch worker'}); "
              f"client reconnection backoff: {backoff}, full jitter; SIGKILL after {args.rounds} rounds of each "
              f"server life, then the identical command line again; {args.repeats} restarts; {os.cpu_count()} CPUs")
        print("server: " + " ".join(Path(c).name if c == py else c for c in server_cmd))
        logs: list[IO[bytes]] = []
        clients: list[subprocess.Popen[bytes]] = []
        server: subprocess.Popen[bytes] | None = None
        try:
            log0 = Path(tmp) / "server-0.log"
            logs.append(open(log0, "wb"))  # noqa: SIM115 (closed below)
            server = subprocess.Popen(server_cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=env)
            clog = open(Path(tmp) / "clients.log", "wb")  # noqa: SIM115
            logs.append(clog)
            clients = [subprocess.Popen(c, stdout=clog, stderr=subprocess.STDOUT, env=env) for c in client_cmds]
            need = args.rounds
            _wait_for(log0, server, lambda ev: len(_completed(ev)) >= need, 120, f"first {need} rounds")
            for rep in range(1, args.repeats + 1):
                time.sleep(args.kill_delay)  # into the next round: a round is in flight when the server dies
                os.kill(server.pid, signal.SIGKILL)
                server.wait()
                log = Path(tmp) / f"server-{rep}.log"
                logs.append(open(log, "wb"))  # noqa: SIM115
                t_exec = time.time()
                server = subprocess.Popen(server_cmd, stdout=logs[-1], stderr=subprocess.STDOUT, env=env)
                events = _wait_for(log, server, lambda ev: len(_completed(ev)) >= 1, 120,
                                   f"restart {rep}: the next round")

                def at(name: str, ev: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
                    return next(e for e in ev if e.get("event") == name
                                and all(e.get(k) == v for k, v in match.items()))

                joins = [e for e in events if e.get("event") == "client.joined"]
                first_done = _completed(events)[0]
                results.append(Restart(
                    resumed_from=int(at("federation.resumed", events)["completed_rounds"]),
                    restored=_stamp(at("federation.resumed", events)) - t_exec,
                    listening=_stamp(at("server.listening", events)) - t_exec,
                    rejoined=(_stamp(joins[args.k - 1]) - t_exec) if len(joins) >= args.k else float("nan"),
                    round_started=_stamp(at("round.started", events)) - t_exec,
                    round_done=_stamp(first_done) - t_exec, round_no=int(first_done["round"])))
                if rep < args.repeats:
                    _wait_for(log, server, lambda ev: len(_completed(ev)) >= need, 120,
                              f"restart {rep}: {need} rounds")
        finally:
            for proc in ([server] if server is not None else []) + clients:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL if proc is server else signal.SIGTERM)
            for proc in ([server] if server is not None else []) + clients:
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
            for f in logs:
                f.close()
    header = (f"{'restart':>7}{'resumed at':>12}{'restored s':>12}{'listening s':>13}{'K rejoined s':>14}"
              f"{'round start s':>15}{'round done s':>14}{'round':>7}")
    print(header)
    print("-" * len(header))
    for i, r in enumerate(results, 1):
        print(f"{i:>7}{r.resumed_from:>12}{r.restored:>12.3f}{r.listening:>13.3f}{r.rejoined:>14.3f}"
              f"{r.round_started:>15.3f}{r.round_done:>14.3f}{r.round_no:>7}")

    def med(get: Callable[[Restart], float]) -> float:
        return statistics.median(get(r) for r in results)

    print(f"{'median':>7}{'':>12}{med(lambda r: r.restored):>12.3f}{med(lambda r: r.listening):>13.3f}"
          f"{med(lambda r: r.rejoined):>14.3f}{med(lambda r: r.round_started):>15.3f}"
          f"{med(lambda r: r.round_done):>14.3f}")
    print("seconds from the restarted server's exec (time.time() before Popen) to its log events: "
          "federation.resumed (state restored), server.listening, the K-th client.joined, round.started, "
          "round.completed of the re-run round; 'resumed at' = completed rounds restored.")
    print(f"server restart -> next completed round: median {med(lambda r: r.round_done):.3f} s "
          f"(state restored and listening after {med(lambda r: r.listening):.3f} s); "
          f"whole mode {time.monotonic() - t_begin:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    snap = sub.add_parser("snapshot", help="time StateStore.save per completed round")
    snap.add_argument("--models", nargs="+", default=list(MODELS), help="model names (fedcore.models)")
    snap.add_argument("--rounds", type=int, default=20, help="timed saves per model and fsync setting")
    snap.add_argument("--clients", type=int, default=100, help="client records in the coordinator state")
    snap.add_argument("--keep", type=int, default=3, help="snapshots kept (StateStore keep)")
    snap.add_argument("--dir", default=None, help="where the temp store goes (default: the system temp dir)")
    snap.set_defaults(func=bench_snapshot)
    grow = sub.add_parser("growth", help="snapshot time at round 10 vs the last round of a long no-op federation")
    grow.add_argument("--rounds", type=int, default=1000, help="rounds of the federation")
    grow.add_argument("-k", type=int, default=10, help="clients per round K (= clients)")
    grow.add_argument("--window", type=int, default=10, help="rounds whose median is reported at each end")
    grow.add_argument("--fsync", action="store_true", help="persistence.fsync on")
    grow.add_argument("--dir", default=None, help="where the temp run dir goes (default: the system temp dir)")
    grow.add_argument("--figures", type=Path, metavar="PATH", default=None,
                      help="write the CPU per snapshot around round 10 and the last round into this figures file "
                           "(docs/figures.toml: snapshot_cpu_early, snapshot_cpu_late)")
    grow.set_defaults(func=bench_growth)
    over = sub.add_parser("overhead", help="per-round overhead of persistence in a live federation (on vs off)")
    over.add_argument("--models", nargs="+", default=["mlp"],
                      help=f"model names; data: {', '.join(f'{m}={d}' for m, (d, _) in OVERHEAD_DATA.items())} "
                           "(cifar10 read offline from the shared data folder)")
    over.add_argument("-k", type=int, default=10, help="clients per round K (= clients)")
    over.add_argument("--rounds", type=int, default=20, help="timed rounds per federation")
    over.add_argument("--warmup", type=int, default=2, help="untimed rounds first in each federation")
    over.add_argument("--pairs", type=int, default=5,
                      help="pairs of federations with persistence on/off (and as many interleaved federations)")
    over.add_argument("--mixed-rounds", type=int, default=40,
                      help="timed rounds of each federation whose rounds take/skip the snapshot alternately")
    over.add_argument("--fsync", action="store_true", help="persistence.fsync on (default off, the server's)")
    over.add_argument("--dir", default=None, help="where the temp run dirs go (default: the system temp dir)")
    over.set_defaults(func=bench_overhead)
    rest = sub.add_parser("restart", help="seconds from a server restart (after SIGKILL) to the next round")
    rest.add_argument("-k", type=int, default=10, help="clients per round K (= clients)")
    rest.add_argument("--repeats", type=int, default=3, help="kill/restart cycles")
    rest.add_argument("--rounds", type=int, default=3, help="rounds each server life completes before the kill")
    rest.add_argument("--kill-delay", type=float, default=0.01,
                      help="seconds after the last observed round completion before SIGKILL")
    rest.add_argument("--backoff-max", type=float, default=0.5, help="clients' longest reconnection backoff, s")
    rest.add_argument("--backoff-initial", type=float, default=0.2,
                      help="clients' first backoff, s (--processes only; the worker keeps the default 0.2)")
    rest.add_argument("--processes", action="store_true", help="one fedclient process per client")
    rest.add_argument("--fsync", action="store_true", help="persistence.fsync on")
    rest.add_argument("--dir", default=None, help="where the temp run dir goes (default: the system temp dir)")
    rest.set_defaults(func=bench_restart)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
