"""Cost model of one fedguard coordinator (issue 30, item 6): how many clients one fedserver serves per round
length and model size, fitted from measurements taken by this script in the same invocation.

Inputs (every one measured here, none hard-coded; re-running the script updates everything):

=====================  ====================================================================================
``F``                  server CPU seconds per round that do not depend on K (selection, snapshot, report,
                       the model packed once per round)
``a``                  server CPU seconds per client-round for a zero-parameter model (the gRPC calls: the
                       long-poll answer, the upload stream, validation, bookkeeping)
``b``                  server CPU seconds per client-round per parameter (the model's chunks written out, the
                       update received, reassembled, validated and folded into the exact FedAvg sum)
``i``                  server CPU seconds per connected (idle, parked) client per second: one long-poll
                       re-issued every ``long_poll_s`` (measured with a short long-poll, scaled to the default)
``d``                  client-host CPU seconds per client-round (only for predicting runs where the clients
                       share the server's cores, as in tools/prototypes/shard_prototype.py)
``L``                  round latency that is not CPU (poll wake-ups, the stream's round trips)
bytes                  wire bytes per client-round: the model down + the update up, protobuf framing included
memory                 server private memory (RssAnon) per connected client and per parameter
bandwidth              memcpy and loopback TCP throughput of this machine (the physical limits)
=====================  ====================================================================================

F, a and b come from a least-squares fit of the server's CPU seconds per round (each ``rounds.jsonl`` row's
``timing_seconds.server_cpu``, fedserver.round_timing) over short runs at several K and two model sizes. The
runs use the same launch as tools/bench/bench_rounds.py (fedserver + ``python -m fedlaunch worker`` client hosts,
no-op trainer, synthetic MLP); this script runs them itself because it also needs the client hosts' CPU and the
server's memory, which bench_rounds samples but does not print per process.

One coordinator (a single Python process: its serving work holds the GIL, so it gets at most ``u`` cores, 1 by
default) with N connected clients, K selected per round, P parameters and rounds of R seconds needs

    CPU per round      C(N, K, P, R) = F + K (a + b P) + N i R           (<= u R)
    bytes per round    K * bytes(P)                                    (<= bandwidth * R)
    memory             M0 + N m_conn + P m_param                         (<= RAM)
    sockets            N (one HTTP/2 connection per client)             (<= the fd limit)

so at a selection fraction f = K / N it serves N = (u R - F) / (f (a + b P) + i R) clients (the table).

    python tools/bench/scaling_model.py              # measure (about 1.5 minutes), fit, print the inputs and the table
    python tools/bench/scaling_model.py --quick      # fewer rounds per run
    python tools/bench/scaling_model.py --framed --ks 6 24 96   # the framed port, three K (a steadier split of F and a)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script
    sys.path.insert(0, str(ROOT))

from tools import procstat  # noqa: E402

# The synthetic MLP's input width and classes (fedcore's synthetic dataset: 60 features, 10 classes).
MLP_IN, MLP_OUT = 60, 10


def mlp_params(hidden: Sequence[int]) -> int:
    """Parameters of the synthetic MLP ``MLP_IN -> hidden... -> MLP_OUT`` (weights and biases)."""
    widths = [MLP_IN, *hidden, MLP_OUT]
    return sum(i * o + o for i, o in itertools.pairwise(widths))


# ---------------------------------------------------------------- the model (pure functions)


@dataclass(frozen=True)
class Costs:
    """The fitted inputs of the cost model (module docstring)."""

    fixed_cpu_per_round: float  # F, s
    cpu_per_client_round: float  # a, s
    cpu_per_param: float  # b, s per client-round per parameter
    idle_cpu_per_client_s: float  # i, s of CPU per connected client per second
    client_cpu_per_client_round: float  # d, s (client hosts)
    latency: float  # L, s per round
    wire_bytes_fixed: float  # bytes per client-round independent of P (framing, headers)
    wire_bytes_per_param: float  # bytes per client-round per parameter (down + up)
    mem_base: float  # bytes
    mem_per_connection: float  # bytes
    mem_per_param: float  # bytes per parameter (the global model's copies, the exact sum's accumulators, ...)
    mem_per_selected_param: float  # bytes per parameter per selected client (uploads in flight)
    bandwidth: float  # bytes/s the server can move (loopback TCP here)
    memcpy_bandwidth: float  # bytes/s
    server_cores: float = 1.0  # u: cores one coordinator process uses for its serving work


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = c0 + c1 x``; (c0, c1). Needs two distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError("fit_line needs at least two distinct x values")
    a = np.column_stack([np.ones(len(xs)), np.asarray(xs, dtype=np.float64)])
    (c0, c1), *_ = np.linalg.lstsq(a, np.asarray(ys, dtype=np.float64), rcond=None)
    return float(c0), float(c1)


def _lstsq3(rows: list[list[float]], y: list[float]) -> tuple[float, float, float]:
    """Least squares of three coefficients, the columns scaled first so lstsq sees comparable magnitudes (a K P
    column is ~1e6 times a K column)."""
    a = np.array(rows, dtype=np.float64)
    scale = np.abs(a).max(axis=0)
    coef, *_ = np.linalg.lstsq(a / scale, np.array(y, dtype=np.float64), rcond=None)
    first, second, third = (float(c) for c in coef / scale)
    return first, second, third


def fit_round_cpu(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares fit of ``cpu = F + K a + K P b`` to (K, P, cpu seconds per round) samples; (F, a, b).
    Needs at least two K at one P and two P (otherwise the system is singular)."""
    if len({k for k, _, _ in samples}) < 2 or len({p for _, p, _ in samples}) < 2:
        raise ValueError("fit_round_cpu needs at least two values of K and two of P")
    return _lstsq3([[1.0, k, k * p] for k, p, _ in samples], [c for _, _, c in samples])


def fit_memory(samples: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least-squares fit of ``memory = M0 + P m + K P m_K`` to (K, P, bytes) samples; (M0, m, m_K). Needs two K at
    the larger P and two P."""
    if len({k for k, _, _ in samples}) < 2 or len({p for _, p, _ in samples}) < 2:
        raise ValueError("fit_memory needs at least two values of K and two of P")
    return _lstsq3([[1.0, p, k * p] for k, p, _ in samples], [m for _, _, m in samples])


def server_cpu_per_round(c: Costs, n: int, k: int, p: int, round_s: float) -> float:
    """C(N, K, P, R) = F + K (a + b P) + N i R."""
    per_client = c.cpu_per_client_round + c.cpu_per_param * p
    return c.fixed_cpu_per_round + k * per_client + n * c.idle_cpu_per_client_s * round_s


def bytes_per_client_round(c: Costs, p: int) -> float:
    return c.wire_bytes_fixed + c.wire_bytes_per_param * p


@dataclass(frozen=True)
class Capacity:
    """How many clients one coordinator serves at a round length and model size, and what binds."""

    round_s: float
    params: int
    fraction: float
    connected: int  # N
    per_round: int  # K = f N
    bound: str  # the binding resource
    limits: dict[str, float] = field(default_factory=dict)  # N allowed by each resource


def capacity(c: Costs, round_s: float, p: int, fraction: float, ram_bytes: float, fd_limit: int) -> Capacity:
    """The largest N (with K = fraction * N selected per round) that fits every resource of one coordinator in
    a round of ``round_s`` seconds: CPU (u R), bandwidth, memory and sockets (module docstring)."""
    if not (0 < fraction <= 1) or round_s <= 0:
        raise ValueError("fraction in (0, 1] and round_s > 0")
    per_client_cpu = fraction * (c.cpu_per_client_round + c.cpu_per_param * p) + c.idle_cpu_per_client_s * round_s
    budget = c.server_cores * round_s - c.fixed_cpu_per_round
    limits = {
        "cpu": max(0.0, budget / per_client_cpu),
        "bandwidth": c.bandwidth * round_s / (fraction * bytes_per_client_round(c, p)),
        "memory": max(0.0, (ram_bytes - c.mem_base - c.mem_per_param * p)
                      / (c.mem_per_connection + fraction * p * c.mem_per_selected_param)),
        "sockets": float(fd_limit),
    }
    bound = min(limits, key=lambda name: limits[name])
    n = math.floor(limits[bound])
    return Capacity(round_s, p, fraction, n, math.floor(fraction * n), bound, limits)


@dataclass(frozen=True)
class SharedPrediction:
    """What the model predicts for S shards (coordinator processes) sharing ``cores`` with their clients."""

    shards: int
    round_s: float  # each shard's round
    server_cpu: float  # each shard's server CPU per round
    client_rounds_per_s: float  # all shards together


def predict_shared(c: Costs, shards: int, n_per_shard: int, k_per_shard: int, p: int, cores: float,
                   hosts_per_shard: int = 1) -> SharedPrediction:
    """Wall seconds per round of S independent shards, each a coordinator with ``n_per_shard`` clients of which
    ``k_per_shard`` per round spread over ``hosts_per_shard`` client-host processes, when the servers and the
    client hosts share ``cores`` (this machine; pass the cores left after other load).

    Greedy scheduling of a round's CPU work (Brent's bound, T <= span + (work - span) / cores). The *span* is the
    longest serial chain: a shard's server CPU C_srv / u (one Python process) or one client host's share of the
    clients' CPU, K d / hosts (its virtual clients are threads under one GIL), whichever is longer. The *work* is
    what all shards and their clients need per round, S (C_srv + K d). The non-CPU latency L is added:
    ``T = L + span + (work - span) / cores``. C_srv's idle term uses T itself (a fixed point; it converges in a
    few steps because N i is small)."""
    if shards < 1 or cores <= 0 or hosts_per_shard < 1:
        raise ValueError("shards >= 1, cores > 0 and hosts_per_shard >= 1")
    t = c.latency + 1e-3
    srv = 0.0
    cli = k_per_shard * c.client_cpu_per_client_round
    for _ in range(100):
        srv = server_cpu_per_round(c, n_per_shard, k_per_shard, p, t)
        span = max(srv / c.server_cores, cli / hosts_per_shard)
        work = shards * (srv + cli)
        new = c.latency + span + max(0.0, work - span) / cores
        if abs(new - t) < 1e-12:
            break
        t = new
    return SharedPrediction(shards, t, srv, shards * k_per_shard / t)


def brent_round(server_cpu: float, client_cpu: float, hosts: int, cores: float, u: float = 1.0) -> float:
    """One shard's round without the latency L (:func:`predict_shared` at S = 1): span + (work - span) / cores."""
    span = max(server_cpu / u, client_cpu / hosts)
    return span + max(0.0, server_cpu + client_cpu - span) / cores


def dedicated_round_time(c: Costs, n: int, k: int, p: int, client_seconds: float) -> float:
    """Round time of one coordinator on its own cores with the clients elsewhere (devices): L + the clients'
    own turnaround (training, ``client_seconds``) + its serial CPU C / u (the hand-out and the uploads are
    serialised through one process; the fixed point as in :func:`predict_shared`)."""
    t = c.latency + client_seconds
    for _ in range(100):
        new = c.latency + client_seconds + server_cpu_per_round(c, n, k, p, t) / c.server_cores
        if abs(new - t) < 1e-12:
            break
        t = new
    return t


# ---------------------------------------------------------------- exact combine of partial aggregates


def partial_sum(updates: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """A shard's partial FedAvg: (Σ w_i u_i in float64, Σ w_i)."""
    return (weights.to(torch.float64)[:, None] * updates.to(torch.float64)).sum(dim=0), float(weights.sum())


def combine_partials(parts: Sequence[tuple[torch.Tensor, float]]) -> torch.Tensor:
    """The root's combine: (Σ_s S_s) / (Σ_s W_s), rounded to float32 once; exact FedAvg over all updates up to
    the float64 summation's rounding."""
    if not parts:
        raise ValueError("no partial aggregates")
    total = torch.zeros_like(parts[0][0], dtype=torch.float64)
    for s, _ in parts:
        total += s
    return (total / math.fsum(w for _, w in parts)).to(torch.float32)


def combine_fixed_point(parts: Sequence[Any]) -> Any:
    """The root's combine of the shards' exact sums (fedcore.aggregation.fixedpoint.FixedPointSum): the int64
    accumulators and the counts add (modulo 2^64, as one FixedPointSum's adds do), so the combined sum is bit
    for bit the one a single coordinator holding every update would have."""
    from fedcore.aggregation.fixedpoint import MAX_UPDATES, FixedPointSum

    if not parts:
        raise ValueError("no partial sums")
    root = FixedPointSum(parts[0].num_params, workers=1)
    hi, lo = root.hi.numpy().view(np.uint64), root.lo.numpy().view(np.uint64)
    for part in parts:
        if part.num_params != root.num_params:
            raise ValueError("partial sums of different sizes")
        np.add(hi, part.hi.numpy().view(np.uint64), out=hi)
        np.add(lo, part.lo.numpy().view(np.uint64), out=lo)
        root.count += part.count
    if root.count > MAX_UPDATES:
        raise ValueError(f"an exact sum holds at most {MAX_UPDATES} updates")
    return root


def float32_sum_tolerance(values: torch.Tensor, roundings_per_term: int = 0) -> torch.Tensor:
    """A per-coordinate bound on |float32 evaluation - exact| of the sum over rows of ``values`` [n, P] (the
    terms of a weighted mean, already multiplied by their normalised weights): the n - 1 float32 additions of
    partial sums of magnitude at most Σ|x_i| plus ``roundings_per_term`` roundings in forming each term bound
    the error by gamma_m Σ|x_i| with m = n + roundings_per_term and gamma_m = m u / (1 - m u), u = 2^-24
    (Higham, Accuracy and Stability of Numerical Algorithms, 2002, eq. 4.4 and lemma 3.1); the final rounding
    to float32 adds u |Σ x_i|."""
    u = 2.0 ** -24
    m = values.shape[0] + roundings_per_term
    if m * u >= 1:
        raise ValueError("too many terms for a float32 error bound")
    gamma = m * u / (1 - m * u)
    v = values.to(torch.float64)
    return gamma * v.abs().sum(dim=0) + u * v.sum(dim=0).abs()


# ---------------------------------------------------------------- measurement harness


def proc_cpu(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` (/proc/PID/stat)."""
    return procstat.cpu_seconds(pid)


def rss_anon(pid: int) -> float | None:
    """RssAnon of ``pid`` in bytes."""
    mib = procstat.rss_anon_mib(pid)
    return None if mib is None else mib * 1024.0 * 1024.0


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


MACHINE = "__machine__"  # the Sampler's trace of the whole machine's busy CPU seconds


class Sampler:
    """Samples (wall time, CPU seconds) of processes every ``period`` seconds in a thread, and their peak
    RssAnon."""

    def __init__(self, pids: dict[str, int], period: float = 0.02) -> None:
        self.pids = dict(pids)
        self.trace: dict[str, list[tuple[float, float]]] = {name: [] for name in (*pids, MACHINE)}
        self.peak_anon: dict[str, float] = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._period = period
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            self.trace[MACHINE].append((now, machine_busy()))
            for name, pid in self.pids.items():
                cpu = proc_cpu(pid)
                if cpu is not None:
                    self.trace[name].append((now, cpu))
                anon = rss_anon(pid)
                if anon is not None:
                    self.peak_anon[name] = max(self.peak_anon[name], anon)
            self._stop.wait(self._period)

    def cpu_between(self, name: str, t0: float, t1: float) -> float:
        """CPU seconds of ``name`` between wall times t0 and t1 (linear interpolation between the samples that
        bracket each time: a sampler starved by a busy machine leaves gaps)."""
        tr = self.trace[name]
        if not tr:
            return 0.0
        times = np.array([s[0] for s in tr])
        cpu = np.array([s[1] for s in tr])
        return float(np.interp(t1, times, cpu) - np.interp(t0, times, cpu))


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


# Extra fedserver flags of every measured run (``--framed``: the framed Session transport).
SERVER_FLAGS: list[str] = ["--framed-address", ""]  # gRPC's Session stream unless --framed


def server_command(address: str, run_dir: Path, rounds: int, k: int, min_available: int, hidden: Sequence[int],
                   extra: Sequence[str] = ()) -> list[str]:
    """fedserver's command line as tools/bench/bench_rounds.py builds it."""
    return [sys.executable, "-m", "fedserver", "--address", address, "--rounds", str(rounds), "-k", str(k),
            "--run-dir", str(run_dir), "--log-json", "--log-level", "info", "--linger", "10",
            "--min-available", str(min_available), "--model-kwargs", json.dumps({"hidden": list(hidden)}),
            "--insecure", *SERVER_FLAGS, *extra]


def client_commands(address: str, n: int, procs: int, tmp: Path, tag: str) -> list[list[str]]:
    """Client hosts (virtual clients as threads, no-op trainer), ``procs`` processes for ``n`` clients."""
    from fedlaunch.hosts import HostSpec, worker_command

    per = -(-n // procs)
    return [worker_command(HostSpec(address, first, min(per, n - first), trainer="noop"),
                           tmp / f"{tag}-host-{first}.json") for first in range(0, n, per)]


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _events(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


@dataclass(frozen=True)
class ShardRun:
    """One coordinator's measured rounds (the warm-up round excluded)."""

    n: int
    k: int
    params: int
    round_s: float  # median server-side round seconds (timing_seconds.round)
    wall_per_round: float  # wall seconds between the first and the last timed round's completion / rounds
    server_cpu: float  # median server CPU seconds per round (timing_seconds.server_cpu)
    client_cpu_per_round: float  # the client hosts' CPU per round (sampled, between the same completions)
    server_anon: float  # peak RssAnon of the server, bytes
    rounds: int
    completions: tuple[float, ...] = ()  # wall times of the timed rounds' completions (the warm-up's first)
    hosts: int = 1  # client-host processes of this shard
    others_cores: float = 0.0  # CPU the rest of the machine used meanwhile (cores; other sessions' benchmarks)


def run_fleet(shards: Sequence[tuple[int, int]], hidden: Sequence[int], rounds: int, procs_per_shard: int,
              timeout: float = 240.0) -> list[ShardRun]:
    """Run S coordinators at once on this machine, shard s with ``shards[s] = (n, k)``: its fedserver and
    ``procs_per_shard`` client-host processes of n virtual clients, ``rounds`` timed rounds after one warm-up.
    Every process's CPU is sampled; each shard's rounds come from its rounds.jsonl and log."""
    env = _env()
    with TemporaryDirectory(prefix="scaling-") as tmp_s:
        tmp = Path(tmp_s)
        procs: dict[str, subprocess.Popen[bytes]] = {}
        logs: list[Path] = []
        try:
            for s, (n, k) in enumerate(shards):
                address = f"127.0.0.1:{procstat.free_port()}"
                log = tmp / f"server-{s}.log"
                logs.append(log)
                procs[f"server-{s}"] = subprocess.Popen(
                    server_command(address, tmp / f"run-{s}", rounds + 1, k, n, hidden),
                    stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
                for j, cmd in enumerate(client_commands(address, n, procs_per_shard, tmp, f"s{s}")):
                    procs[f"clients-{s}-{j}"] = subprocess.Popen(
                        cmd, stdout=open(tmp / f"clients-{s}-{j}.log", "wb"),  # noqa: SIM115
                        stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + timeout
            with Sampler({name: p.pid for name, p in procs.items()}) as sampler:
                for name, p in procs.items():
                    rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                    if rc != 0:
                        tail = tmp / f"{name}.log"
                        raise RuntimeError(f"{name} exited {rc}: "
                                           + (tail.read_text()[-2000:] if tail.exists() else ""))
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out = []
        for s, (n, k) in enumerate(shards):
            events = _events(logs[s])
            params = int(next(e["params"] for e in events if e.get("event") == "federation.started"))
            done = [_stamp(e) for e in events if e.get("event") == "round.completed"]
            if len(done) != rounds + 1:
                raise RuntimeError(f"shard {s}: {len(done)} rounds completed, expected {rounds + 1}")
            rows = [json.loads(line) for line in (tmp / f"run-{s}" / "rounds.jsonl").read_text().splitlines()
                    if line.strip()][1:]
            timing = [r["timing_seconds"] for r in rows]
            t0, t1 = done[0], done[-1]
            client_cpu = sum(sampler.cpu_between(name, t0, t1) for name in procs if name.startswith(f"clients-{s}-"))
            ours = sum(sampler.cpu_between(name, t0, t1) for name in procs)
            others = max(0.0, (sampler.cpu_between(MACHINE, t0, t1) - ours) / (t1 - t0))
            hosts = sum(name.startswith(f"clients-{s}-") for name in procs)
            out.append(ShardRun(n, k, params, statistics.median(t["round"] for t in timing), (t1 - t0) / rounds,
                                statistics.median(t["server_cpu"] for t in timing), client_cpu / rounds,
                                sampler.peak_anon[f"server-{s}"], rounds, tuple(done), hosts, others))
        return out


@dataclass(frozen=True)
class IdleRun:
    clients: int
    long_poll_s: float
    cpu_rate_before: float  # server CPU s/s with no client
    cpu_rate_after: float  # with the clients parked in their long-polls
    anon_before: float
    anon_after: float
    fds_before: int
    fds_after: int


def measure_idle(n: int, long_poll_s: float, window: float, procs: int = 2) -> IdleRun:
    """A server that never starts a round (``--min-available N + 1``) with a ``long_poll_s`` long-poll: its CPU
    rate, RssAnon and open fds over ``window`` seconds before and after N clients connect."""
    env = _env()
    with TemporaryDirectory(prefix="scaling-idle-") as tmp_s:
        tmp = Path(tmp_s)
        address = f"127.0.0.1:{procstat.free_port()}"
        log = tmp / "server.log"
        server = subprocess.Popen(
            server_command(address, tmp / "run", 1, n, n + 1, [64], ["--set", f"server.long_poll_s={long_poll_s}"]),
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        clients: list[subprocess.Popen[bytes]] = []
        try:
            deadline = time.monotonic() + 60
            while not any(e.get("event") == "server.listening" for e in _events(log)):
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("idle server did not start: " + log.read_text()[-2000:])
                time.sleep(0.1)
            time.sleep(0.5)
            c0, t0, a0, f0 = proc_cpu(server.pid), time.time(), rss_anon(server.pid), open_fds(server.pid)
            time.sleep(window)
            c1, t1 = proc_cpu(server.pid), time.time()
            clients = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
                       for c in client_commands(address, n, procs, tmp, "idle")]
            while sum(e.get("event") == "client.joined" for e in _events(log)) < n:
                if time.monotonic() > deadline + 60:
                    raise RuntimeError("idle clients did not join")
                time.sleep(0.2)
            time.sleep(2 * long_poll_s)  # every client has re-polled at least once
            c2, t2, a2, f2 = proc_cpu(server.pid), time.time(), rss_anon(server.pid), open_fds(server.pid)
            time.sleep(window)
            c3, t3 = proc_cpu(server.pid), time.time()
        finally:
            for p in (*clients, server):
                if p.poll() is None:
                    p.terminate()
            for p in (*clients, server):
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        if c0 is None or c1 is None or c2 is None or c3 is None or a0 is None or a2 is None:
            raise RuntimeError("the idle server's /proc entries could not be read")
        return IdleRun(n, long_poll_s, (c1 - c0) / (t1 - t0), (c3 - c2) / (t3 - t2), a0, a2, f0, f2)


@dataclass(frozen=True)
class WireRun:
    params: int
    wire_bytes: int  # frames of one model (header + chunks)
    encode_s: float
    decode_s: float


def measure_wire(params: int, reps: int = 5) -> WireRun:
    """Frames of a ``params``-parameter float32 model as fedserver sends them (fedguard.wire, as
    tools/bench/bench_serialization.py's ``wire`` path), their bytes, and the median encode/decode seconds."""
    from fedcore.serialization import Reassembler, payload_of
    from fedguard import wire
    from fedguard.v1 import fedguard_pb2 as pb

    state = {"w": torch.randn(params, generator=torch.Generator().manual_seed(0))}
    enc: list[float] = []
    dec: list[float] = []
    nbytes = 0
    for _ in range(reps):
        t0 = time.perf_counter()
        manifest, payload = payload_of(state)
        header = pb.TaskMessage(header=pb.TaskHeader(tensors=wire.metas_to_pb(manifest), total_bytes=len(payload)))
        frames = [header.SerializeToString(), *wire.chunk_frame_bytes(payload, pb.TaskMessage)]
        t1 = time.perf_counter()
        first = pb.TaskMessage.FromString(frames[0]).header
        asm = Reassembler(wire.metas_from_pb(first.tensors), first.total_bytes)
        for f in frames[1:]:
            chunk = wire.read_chunk(f, pb.TaskMessage)
            assert chunk is not None
            asm.feed(*chunk)
        asm.finish()
        t2 = time.perf_counter()
        enc.append(t1 - t0)
        dec.append(t2 - t1)
        nbytes = sum(map(len, frames))
    return WireRun(params, nbytes, statistics.median(enc), statistics.median(dec))


def measure_memcpy(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Bytes/s of one large copy (median)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def measure_loopback(nbytes: int = 128 << 20) -> float:
    """Bytes/s through one loopback TCP connection (a thread sends, this one receives)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    block = b"\0" * (1 << 20)

    def send() -> None:
        with socket.create_connection(srv.getsockname()) as c:
            for _ in range(nbytes // len(block)):
                c.sendall(block)

    th = threading.Thread(target=send)
    t0 = time.perf_counter()
    th.start()
    conn, _ = srv.accept()
    got = 0
    buf = bytearray(1 << 20)
    with conn:
        while got < nbytes:
            r = conn.recv_into(buf)
            if not r:
                break
            got += r
    th.join()
    dt = time.perf_counter() - t0
    srv.close()
    return got / dt


# ---------------------------------------------------------------- calibration


@dataclass
class Calibration:
    costs: Costs
    runs: list[ShardRun]
    idle: IdleRun
    wires: list[WireRun]
    notes: list[str]


SMALL = (64,)  # 4,554 parameters
LARGE = (512, 256)  # 165,130 parameters


def calibrate(rounds: int, ks: Sequence[int] = (6, 24), idle_clients: int = 200, idle_long_poll: float = 1.0,
              default_long_poll: float | None = None) -> Calibration:
    """Measure every input of the model on this machine now (module docstring) and fit it; the idle cost is scaled
    to ``default_long_poll`` (None: the server's default ``server.long_poll_s``)."""
    if default_long_poll is None:
        from fedcore.config import ServerSection

        default_long_poll = ServerSection().long_poll_s
    notes: list[str] = []
    runs: list[ShardRun] = []
    for k in ks:
        runs += run_fleet([(k, k)], SMALL, rounds, 2)
        runs += run_fleet([(k, k)], LARGE, rounds, 2)
    samples = [(r.k, r.params, r.server_cpu) for r in runs]
    f, a, b = fit_round_cpu(samples)
    if f < 0:  # noise can push the intercept below 0; a negative fixed cost is meaningless
        notes.append(f"the fitted F was {f * 1000:.3f} ms (< 0, noise): F = 0 and a, b refitted through the origin")
        a_mat = np.array([[k, k * p] for k, p, _ in samples], dtype=np.float64)
        y = np.array([c for _, _, c in samples])
        sc = a_mat.max(axis=0)
        coef, *_ = np.linalg.lstsq(a_mat / sc, y, rcond=None)
        f, (a, b) = 0.0, (float(x) for x in coef / sc)
    d = statistics.median(r.client_cpu_per_round / r.k for r in runs if r.params == mlp_params(SMALL))
    # L: what the calibration rounds took beyond their CPU bound (1 shard, 2 cores)
    cores = float(os.cpu_count() or 1)
    lat = statistics.median(r.wall_per_round - brent_round(r.server_cpu, r.client_cpu_per_round, r.hosts,
                                                           max(0.25, cores - r.others_cores)) for r in runs)
    idle = measure_idle(idle_clients, idle_long_poll, window=3.0)
    per_poll = max(0.0, idle.cpu_rate_after - idle.cpu_rate_before) * idle_long_poll / idle_clients
    i = per_poll / default_long_poll
    wires = [measure_wire(p) for p in (mlp_params(SMALL), 1_000_000)]
    w0, w1 = fit_line([w.params for w in wires], [float(w.wire_bytes) for w in wires])
    m0, mem_param, mem_kparam = fit_memory([(r.k, r.params, r.server_anon) for r in runs])
    mem_conn = max(0.0, (idle.anon_after - idle.anon_before) / idle_clients)
    loop = measure_loopback()
    costs = Costs(fixed_cpu_per_round=f, cpu_per_client_round=a, cpu_per_param=b, idle_cpu_per_client_s=i,
                  client_cpu_per_client_round=d, latency=max(0.0, lat), wire_bytes_fixed=2 * w0,
                  wire_bytes_per_param=2 * w1, mem_base=m0, mem_per_connection=mem_conn,
                  mem_per_param=max(0.0, mem_param), mem_per_selected_param=max(0.0, mem_kparam),
                  bandwidth=loop, memcpy_bandwidth=measure_memcpy())
    return Calibration(costs, runs, idle, wires, notes)


def print_inputs(cal: Calibration) -> None:
    c = cal.costs
    print("measured runs (fedserver + client hosts of virtual clients, no-op trainer, N = K, "
          f"{cal.runs[0].rounds} timed rounds after 1 warm-up, 2 client processes):")
    print(f"  {'K':>4} {'params':>9} {'round s':>8} {'wall/rnd':>8} {'srv CPU/rnd':>11} {'ms/client-rnd':>13} "
          f"{'client CPU/rnd':>14} {'srv RssAnon MiB':>15} {'other load':>10}")
    for r in cal.runs:
        print(f"  {r.k:4d} {r.params:9,d} {r.round_s:8.4f} {r.wall_per_round:8.4f} {r.server_cpu:11.4f} "
              f"{1000 * r.server_cpu / r.k:13.3f} {r.client_cpu_per_round:14.4f} "
              f"{r.server_anon / 2**20:15.0f} {r.others_cores:10.2f}")
    i = cal.idle
    print(f"  idle: {i.clients} parked clients, long_poll_s = {i.long_poll_s}: server CPU {i.cpu_rate_before:.4f} -> "
          f"{i.cpu_rate_after:.4f} s/s, RssAnon {i.anon_before / 2**20:.0f} -> {i.anon_after / 2**20:.0f} MiB, "
          f"fds {i.fds_before} -> {i.fds_after}")
    for w in cal.wires:
        print(f"  wire: {w.params:,} params -> {w.wire_bytes:,} bytes per model, encode {1000 * w.encode_s:.3f} ms, "
              f"decode {1000 * w.decode_s:.3f} ms")
    print("fitted inputs:")
    print(f"  F  fixed server CPU per round        {1000 * c.fixed_cpu_per_round:9.3f} ms   (lstsq over the runs)")
    print(f"  a  server CPU per client-round       {1000 * c.cpu_per_client_round:9.3f} ms   (lstsq, P -> 0)")
    print(f"  b  server CPU per client-round/param {1e9 * c.cpu_per_param:9.3f} ns   (lstsq, from the two model sizes)")
    print(f"  i  idle server CPU per client per s  {1e6 * c.idle_cpu_per_client_s:9.3f} us   "
          f"(idle run's CPU per re-poll / default long_poll_s 20)")
    print(f"  d  client-host CPU per client-round  {1000 * c.client_cpu_per_client_round:9.3f} ms   "
          "(sampled /proc of the hosts, 4.5k params)")
    print(f"  L  non-CPU latency per round         {1000 * c.latency:9.3f} ms   "
          "(median of wall/round - brent_round over the runs, cores left by other load)")
    print(f"  bytes per client-round               {c.wire_bytes_fixed:9.0f} + {c.wire_bytes_per_param:.4f} P "
          "(model down + update up, fedguard.wire frames)")
    print(f"  server memory                        {c.mem_base / 2**20:9.0f} MiB + "
          f"{c.mem_per_connection / 1024:.1f} KiB "
          f"per connection + {c.mem_per_param:.1f} B per param + {c.mem_per_selected_param:.2f} B per param per "
          "selected client (lstsq of peak RssAnon over the runs; per connection: the idle run)")
    print(f"  loopback TCP {c.bandwidth / 1e9:.2f} GB/s, memcpy {c.memcpy_bandwidth / 1e9:.2f} GB/s, "
          f"coordinator cores u = {c.server_cores:g} (one Python process)")
    for note in cal.notes:
        print(f"  note: {note}")


def ram_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def print_capacity(c: Costs, fractions: Sequence[float] = (1.0, 0.1, 0.01),
                   round_lengths: Sequence[float] = (10.0, 60.0),
                   sizes: Sequence[int] = (4_554, 1_000_000, 10_000_000)) -> None:
    fd = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    ram = ram_bytes()
    print(f"capacity of one coordinator (u = {c.server_cores:g} core, RAM {ram / 2**30:.1f} GiB, fd limit {fd}); "
          "N connected, K = f N selected per round:")
    print(f"  {'round':>6} {'params':>11} {'f':>5} {'N':>10} {'K':>9}  bound      "
          f"{'N(cpu)':>10} {'N(bw)':>10} {'N(mem)':>10}  srv s/client-round")
    for r in round_lengths:
        for p in sizes:
            for f in fractions:
                cap = capacity(c, r, p, f, ram, fd)
                per = c.cpu_per_client_round + c.cpu_per_param * p
                print(f"  {r:5.0f}s {p:11,d} {f:5g} {cap.connected:10,d} {cap.per_round:9,d}  {cap.bound:<9} "
                      f"{cap.limits['cpu']:10.3g} {cap.limits['bandwidth']:10.3g} {cap.limits['memory']:10.3g}  "
                      f"{per:.4g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds per calibration run")
    ap.add_argument("--quick", action="store_true", help="4 timed rounds per run")
    ap.add_argument("--framed", action="store_true",
                    help="measure with the framed Session transport (server.framed_address) instead of gRPC's")
    ap.add_argument("--ks", type=int, nargs="+", default=[6, 24], metavar="K",
                    help="the K of the calibration runs (N = K; each with both model sizes); more and larger K "
                         "separate the fixed cost F from the per-client cost a more stably (default: 6 24)")
    args = ap.parse_args()
    if len(set(args.ks)) < 2 or min(args.ks) < 1:
        ap.error("--ks: at least two different K >= 1 (F and a are fitted from the runs' K)")
    if args.framed:
        SERVER_FLAGS[:] = ["--framed-address", "127.0.0.1:0"]
    torch.set_num_threads(1)
    t0 = time.monotonic()
    cal = calibrate(4 if args.quick else args.rounds, ks=args.ks)
    print_inputs(cal)
    print_capacity(cal.costs)
    print(f"(measured and fitted in {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
