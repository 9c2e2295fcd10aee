"""``fedguard-launch``: one ``fedserver`` plus N clients, printing one line per round.

    fedguard-launch --clients 10 --rounds 20                        # 10 fedclient processes
    fedguard-launch --clients 200 --virtual --procs 4               # 200 virtual clients in 4 processes
    fedguard-launch --clients 10 -k 10 --trainer noop               # protocol only (benchmarks)
    fedguard-launch --config configs/mnist_nfl.toml                 # an experiment file
    fedguard-launch --clients 1000 -k 100 --procs 10 --ray auto     # client hosts as Ray actors (fedguard[ray])
    fedguard-launch --clients 100 --virtual --dropout 0.3 --straggler lognormal --straggler-delay 2

An experiment file is a server configuration (TOML) plus an optional ``[launch]`` table with the launcher's
own options (``clients``, ``virtual``, ``procs``, ``attackers`` = fraction of attacker clients, ``attack`` =
an attack table, ``private_epochs``, ``device`` = where clients train); command-line flags win over it.
Attackers are a seeded random subset of the client indices.

Transport: mutual TLS by default. The launcher makes a throw-away CA, a server certificate for the server's
address and one certificate per client in a private temporary directory (deleted when it exits); ``--tls-dir
DIR`` uses certificates made with ``fedguard-certs`` instead (``ca.pem``, ``server.pem``/``server.key``,
``clients/<client-id>.pem``/``.key`` and ``clients/launcher.pem``/``.key`` for the status view), and
``--insecure`` runs plaintext gRPC.

Every client is a real gRPC client with its own channel; in ``--virtual`` mode each host process runs many of
them as threads, each with its own shard (so a thousand clients fit on a small machine). With ``--ray`` the
hosts are Ray actors placed across a Ray cluster by the resources each asks for (``--ray-cpus``, ``--ray-gpus``,
``--ray-resources``), reaching the server at ``--server-host`` (default: this node's address); the server stays a
process on this machine. Device behaviour is simulated with seeded fractions (``--stragglers``, ``--dropout``,
``--crash``, an ``--availability`` trace; see :mod:`fedcore.simulation`). Server options not covered by a flag go
through ``--server-set section.key=value``. Logs land in the run directory (``server.log``, ``clients-*.log``;
Ray actors log to Ray's session directory); the final model and ``rounds.jsonl`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from fedcore.report import RoundReport  # no torch: --help stays fast

COLUMNS = ("round", "selected", "accepted", "rejected", "late", "abandoned", "train_loss", "test_acc", "beta_hat",
           "beta", "beta_b", "adapt", "nfl", "clusters", "seconds")
_WIDTHS = (5, 8, 8, 8, 4, 9, 10, 8, 8, 7, 7, 5, 12, 8, 8)
LAUNCH_KEYS = {"clients", "virtual", "procs", "attackers", "attack", "private_epochs", "rounds", "k", "trainer",
               "device", "holdouts"}
TRAINER_CHOICES = ("flguard", "lindt", "ditto", "apfl", "ft", "fb", "fedntd", "moon", "hydra", "vanilla", "noop")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fmt(v: float, digits: int = 4) -> str:
    return "-" if v != v else f"{v:.{digits}f}"  # NaN prints as "-"


def format_header() -> str:
    return " ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, _WIDTHS, strict=True))


def format_row(h: RoundReport) -> str:
    """One round: late is the running total of uploads refused because their round had closed, abandoned the
    attempts of this round given up for too few updates before the one that completed; beta_hat is the round's
    median of the clients' beta_hat_i, beta the mean V_i - P_i on their full test splits, adapt the participants
    that ran their recovery, nfl the detector's state and count, clusters the number of DistFL clusters ("-"
    without DistFL or before the first clustering)."""
    nfl = h.nfl if h.nfl in ("off", "always") else f"{h.nfl}:{h.nfl_count}"
    if h.recovery and h.nfl == "watching":
        nfl += "+rec"  # long-term recovery carries on after a cancel
    return (f"{h.round:>5} {h.selected:>8} {h.accepted:>8} {h.rejected:>8} {h.late_total:>4} {h.attempt:>9} "
            f"{_fmt(h.mean_train_loss):>10} "
            f"{_fmt(h.mean_test_accuracy):>8} {_fmt(h.beta_hat, 3):>8} {_fmt(h.beta, 3):>7} "
            f"{_fmt(h.beta_benign, 3):>7} {h.adapting:>5} {nfl:>12} {len(h.clusters) or '-':>8} {h.seconds:>8.3f}")


def attacker_indices(num_clients: int, fraction: float, seed: int) -> list[int]:
    """A seeded random ``round(fraction * N)`` of the client indices."""
    import numpy as np

    n = round(fraction * num_clients)
    rng = np.random.default_rng([seed, 0xA77AC4])
    return sorted(int(i) for i in rng.choice(num_clients, size=n, replace=False))


def holdout_indices(num_clients: int, fraction: float, seed: int, attackers: list[int]) -> list[int]:
    """A seeded random ``round(fraction * benign clients)`` of the benign client indices: the opt-out holdouts."""
    import numpy as np

    benign = [i for i in range(num_clients) if i not in set(attackers)]
    n = round(fraction * len(benign))
    rng = np.random.default_rng([seed, 0x401D0])
    return sorted(int(benign[i]) for i in rng.choice(len(benign), size=n, replace=False))


def simulation_plan(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each client's ``[simulation]`` fields from the launcher's flags (only those that differ from the defaults):
    a seeded ``--stragglers`` fraction straggles, every client drops out and crashes with the given per-round
    probabilities, and an ``--availability`` trace gives each client its windows. :class:`ValueError` for a
    malformed value (checked here, before anything starts)."""
    import numpy as np

    from fedcore.config import ConfigError, from_dict
    from fedcore.simulation import SimulationConfig, load_trace, trace_windows

    if not 0 <= args.stragglers <= 1:
        raise ValueError(f"--stragglers must be a fraction in [0, 1], got {args.stragglers}")
    n = args.clients
    order = np.random.default_rng([args.seed or 0, 0x57A6]).permutation(n)
    stragglers = set(order[: round(args.stragglers * n)].tolist())
    trace = load_trace(args.availability) if args.availability else {}
    plan: dict[str, dict[str, Any]] = {}
    for i in range(n):
        sim: dict[str, Any] = {"seed": args.seed or 0}
        if args.straggler_delay and i in stragglers:
            sim.update(straggler=args.straggler, straggler_delay_s=args.straggler_delay,
                       straggler_sigma=args.straggler_sigma)
        if args.dropout:
            sim.update(dropout=args.dropout, dropout_return_s=args.dropout_return)
        if args.crash:
            sim.update(crash=args.crash, crash_rejoin_s=args.crash_rejoin)
        windows = trace_windows(trace, client_id(i))
        if windows:
            sim["availability"] = windows
        try:
            from_dict(SimulationConfig, sim, "simulation").validate("simulation")
        except ConfigError as e:
            raise ValueError(str(e)) from None
        plan[client_id(i)] = sim
    return plan


def split_experiment(path: str, run_dir: Path) -> tuple[dict[str, Any], Path]:
    """Read an experiment file; return its ``[launch]`` table and the path of the server part (as JSON)."""
    from fedcore.config import load_toml

    data = load_toml(path)
    launch = data.pop("launch", {})
    unknown = set(launch) - LAUNCH_KEYS
    if unknown:
        raise SystemExit(f"launch: unknown [launch] keys {sorted(unknown)}; known: {sorted(LAUNCH_KEYS)}")
    server_part = run_dir / "server_config.json"
    server_part.write_text(json.dumps(data, indent=2))
    return dict(launch), server_part


def client_id(index: int) -> str:
    return f"client-{index:05d}"


STATUS_CLIENT = "launcher"


def make_tls_dir(client_ids: list[str], directory: Path | None = None, days: int = 2,
                 server_hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Path:
    """A CA, a server certificate for ``server_hosts`` and a certificate per client (plus the launcher's own,
    for its status view), in the layout ``--tls-dir`` reads. Keys are written 0600 in a 0700 directory."""
    from fedguard.certs import issue_client_cert, issue_server_cert, make_ca, write_ca, write_private, write_public

    d = directory or Path(tempfile.mkdtemp(prefix="fedguard-tls-"))
    ca = make_ca("fedguard launcher CA", days=days)
    write_ca(d, ca)
    server = issue_server_cert(ca, list(dict.fromkeys(server_hosts)), days=days)
    write_public(d / "server.pem", server.cert_pem)
    write_private(d / "server.key", server.key_pem)
    for cid in [*client_ids, STATUS_CLIENT]:
        c = issue_client_cert(ca, cid, days=days)
        write_public(d / "clients" / f"{cid}.pem", c.cert_pem)
        write_private(d / "clients" / f"{cid}.key", c.key_pem)
    return d


def server_tls_flags(tls_dir: Path | None) -> list[str]:
    if tls_dir is None:
        return ["--insecure"]
    return ["--tls-cert", str(tls_dir / "server.pem"), "--tls-key", str(tls_dir / "server.key"),
            "--client-ca", str(tls_dir / "ca.pem")]


def client_tls_options(tls_dir: Path | None, cid: str) -> dict[str, Any]:
    """ClientConfig fields of client ``cid`` (its certificate in ``tls_dir``), or plaintext without one."""
    if tls_dir is None:
        return {"insecure": True}
    return {"ca_cert": str(tls_dir / "ca.pem"), "cert": str(tls_dir / "clients" / f"{cid}.pem"),
            "key": str(tls_dir / "clients" / f"{cid}.key")}


def client_tls_flags(tls_dir: Path | None, cid: str) -> list[str]:
    return [item for k, v in client_tls_options(tls_dir, cid).items()
            for item in (f"--{k.replace('_', '-')}",) + (() if v is True else (str(v),))]


class Host(Protocol):
    """A client host: a worker process here (:class:`subprocess.Popen`) or a Ray actor (:mod:`fedguard.launch_ray`).
    ``wait`` raises :class:`subprocess.TimeoutExpired` when the host is still running after ``timeout``."""

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...


@dataclass
class Launch:
    server: subprocess.Popen[bytes]
    clients: list[Host]
    address: str
    logs: list[IO[bytes]]


def start(args: argparse.Namespace, run_dir: Path) -> Launch:
    from fedcore.config import toml_literal

    port = args.port or _free_port()
    # With Ray, hosts on other machines reach the server at --server-host (default: this node's IP).
    address = f"{args.server_host}:{port}"
    listen = f"0.0.0.0:{port}" if args.ray else address
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    server_cmd = [py, "-m", "fedserver", "--address", listen, "--run-dir", str(run_dir), "--log-json",
                  "--linger", "30", *server_tls_flags(args.tls_dir)]
    for flag, value in (("--rounds", args.rounds), ("-k", args.k), ("--seed", args.seed)):
        if value is not None:
            server_cmd += [flag, str(value)]
    if args.server_config:
        server_cmd += ["--config", str(args.server_config)]
    if args.k is None and not args.server_config:
        server_cmd += ["-k", str(args.clients)]
    if args.min_updates is not None:
        server_cmd += ["--min-updates", str(args.min_updates)]
    if args.min_available is not None:
        server_cmd += ["--min-available", str(args.min_available)]
    if args.round_timeout is not None:
        server_cmd += ["--round-timeout", str(args.round_timeout)]
    if args.nfl_mode is not None:
        server_cmd += ["--nfl-mode", args.nfl_mode]
    for item in args.server_set:
        server_cmd += ["--set", item]
    if not args.resume:
        server_cmd.append("--fresh")
    mode = "ab" if args.resume else "wb"
    logs: list[IO[bytes]] = []
    slog = open(run_dir / "server.log", mode)  # noqa: SIM115 (closed in finish())
    logs.append(slog)
    server = subprocess.Popen(server_cmd, stdout=slog, stderr=subprocess.STDOUT, env=env)
    clients: list[Host] = []
    procs = args.procs if args.virtual else args.clients
    per_proc = math.ceil(args.clients / max(procs, 1))
    if args.ray:
        from fedguard.launch_ray import start_ray_hosts

        specs = [host_spec(args, address, first, min(per_proc, args.clients - first), ship_tls=True)
                 for first in range(0, args.clients, per_proc)]
        clients.extend(start_ray_hosts(args, specs))
        return Launch(server, clients, address, logs)
    for p in range(procs):
        first = p * per_proc
        count = min(per_proc, args.clients - first)
        if count <= 0:
            break
        clog = open(run_dir / f"clients-{p}.log", mode)  # noqa: SIM115
        logs.append(clog)
        if args.virtual:
            cmd = worker_command(host_spec(args, address, first, count), run_dir / "hosts" / f"host-{p}.json")
        else:
            cmd = [py, "-m", "fedclient", "--server", address, "--client-id", client_id(first),
                   "--data-index", str(first), "--trainer", args.trainer, "--torch-threads", "1", "--log-json",
                   "--log-level", "warning",
                   "--private-epochs", str(args.private_epochs), "--device", args.device,
                   *client_tls_flags(args.tls_dir, client_id(first))]
            if first in args.attacker_ids:
                cmd += [item for k, v in args.attack.items() for item in ("--set", f"attack.{k}={toml_literal(v)}")]
            if first in args.holdout_ids:
                cmd.append("--opt-out")
            sim = args.simulation.get(client_id(first), {})
            cmd += [item for k, v in sim.items() for item in ("--set", f"simulation.{k}={toml_literal(v)}")]
        clients.append(subprocess.Popen(cmd, stdout=clog, stderr=subprocess.STDOUT, env=env))
    return Launch(server, clients, address, logs)


def host_spec(args: argparse.Namespace, address: str, first: int, count: int, ship_tls: bool = False) -> HostSpec:
    """The :class:`HostSpec` of the host running clients ``first`` .. ``first + count - 1``; ``ship_tls`` puts the
    certificates it needs into the spec itself (hosts on other machines cannot read the launcher's files)."""
    ids = [client_id(i) for i in range(first, first + count)]
    tls_files: dict[str, str] = {}
    if ship_tls and args.tls_dir is not None:
        tls_files = {rel: (args.tls_dir / rel).read_text()
                     for rel in ["ca.pem", *(f"clients/{cid}.{ext}" for cid in ids for ext in ("pem", "key"))]}
    return HostSpec(
        server=address, first=first, count=count, trainer=args.trainer, private_epochs=args.private_epochs,
        device=args.device, attackers=[i for i in args.attacker_ids if first <= i < first + count],
        holdouts=[i for i in args.holdout_ids if first <= i < first + count], attack=dict(args.attack),
        simulation={cid: args.simulation.get(cid, {}) for cid in ids},
        tls_dir="" if ship_tls or args.tls_dir is None else str(args.tls_dir), tls_files=tls_files)


def _jsonl_rows(run_dir: Path, after: int) -> list[RoundReport]:
    """Round reports from the server's rounds.jsonl after round ``after``."""
    path = run_dir / "rounds.jsonl"
    rows: list[RoundReport] = []
    if path.exists():
        for line in path.read_text().splitlines():
            r = RoundReport.from_dict(json.loads(line))
            if r.round > after:
                rows.append(r)
    return rows


def watch(launch: Launch, run_dir: Path, interval: float = 0.1, out: IO[str] = sys.stdout,
          tls_dir: Path | None = None) -> int:
    """Print each completed round as the server reports it; returns the server's exit code."""
    import grpc

    from fedclient.transport import open_channel
    from fedcore.config import ClientConfig
    from fedguard import wire
    from fedguard.v1 import fedguard_pb2 as pb
    from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

    channel = open_channel(ClientConfig(server=launch.address, **client_tls_options(tls_dir, STATUS_CLIENT)))
    stub = pb_grpc.FederationStub(channel)  # type: ignore[no-untyped-call]
    history: list[RoundReport] = []
    print(format_header(), file=out, flush=True)
    while True:
        rc = launch.server.poll()
        try:
            st = wire.status_from_pb(stub.GetStatus(pb.StatusRequest(), timeout=2.0))
            last = history[-1].round if history else 0
            for h in st.history:
                if h.round > last:
                    print(format_row(h), file=out, flush=True)
                    history.append(h)
        except grpc.RpcError:
            pass
        if rc is not None:
            channel.close()
            # Rounds that completed after the last poll are in the server's rounds.jsonl.
            for h in _jsonl_rows(run_dir, history[-1].round if history else 0):
                print(format_row(h), file=out, flush=True)
                history.append(h)
            if history:
                print(last_rounds_summary(history), file=out, flush=True)
            return rc
        time.sleep(interval)


def last_rounds_summary(history: list[RoundReport], last: int = 10) -> str:
    """Means over the last ``last`` rounds (the papers' convention), NaN-free values only."""
    tail = history[-last:]

    def mean(get: Any) -> str:
        vals = [v for v in (get(h) for h in tail) if v == v]
        return _fmt(sum(vals) / len(vals)) if vals else "-"

    return (f"last {len(tail)} rounds: test_acc {mean(lambda h: h.mean_test_accuracy)}, "
            f"benign test_acc {mean(lambda h: h.test_accuracy_benign)}, "
            f"beta {mean(lambda h: h.beta)}, "
            f"beta_benign {mean(lambda h: h.beta_benign)}, "
            f"central_acc {mean(lambda h: h.central_accuracy)}")


def finish(launch: Launch, timeout: float = 30.0) -> list[int | None]:
    codes: list[int | None] = []
    deadline = time.monotonic() + timeout
    for c in launch.clients:
        try:
            codes.append(c.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            c.terminate()
            codes.append(None)
    for f in launch.logs:
        f.close()
    return codes


@dataclass
class HostSpec:
    """What one client host runs: ``count`` virtual clients from index ``first`` (a worker process here, or a
    Ray actor anywhere in a Ray cluster: the spec travels by value, so it holds no open files)."""

    server: str
    first: int
    count: int
    trainer: str = ""
    private_epochs: int = 0
    device: str = "cpu"
    backoff_max: float = 10.0
    attackers: list[int] = field(default_factory=list)
    holdouts: list[int] = field(default_factory=list)
    attack: dict[str, Any] = field(default_factory=dict)
    # client id -> its [simulation] fields
    simulation: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Certificates in the launcher's layout: a directory this host can read, or (for hosts on other machines)
    # the PEM files themselves, relative path -> text, written to a private temporary directory on the host.
    tls_dir: str = ""
    tls_files: dict[str, str] = field(default_factory=dict)
    # The name the server's certificate is checked against when ``server`` names it otherwise (an IP the
    # certificate does not list).
    server_name: str = ""


def host_clients(spec: HostSpec) -> int:
    """Host the spec's virtual clients (threads, one gRPC channel each) in this process until the federation
    ends; 0 when every one of them finished."""
    import torch

    from fedclient import ClientConfig, FedClient
    from fedcore.attacks import AttackConfig
    from fedcore.config import from_dict
    from fedcore.log import configure_logging
    from fedcore.simulation import SimulationConfig

    torch.set_num_threads(1)
    configure_logging(json=True, level="warning")
    attack = from_dict(AttackConfig, spec.attack, "attack")
    with contextlib.ExitStack() as stack:
        tls_dir = Path(spec.tls_dir) if spec.tls_dir else None
        if spec.tls_files:
            tls_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedguard-host-tls-")))
            for rel, text in spec.tls_files.items():
                if Path(rel).is_absolute() or ".." in Path(rel).parts:
                    raise ValueError(f"HostSpec.tls_files: {rel!r} is not a path inside the host's own directory")
                path = tls_dir / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch(mode=0o600)
                path.write_text(text)
        named: dict[str, Any] = {"server_name": spec.server_name} if spec.server_name else {}
        clients = [FedClient(ClientConfig(server=spec.server, client_id=client_id(i), data_index=i,
                                          trainer=spec.trainer,
                                          simulation=from_dict(SimulationConfig, spec.simulation.get(client_id(i), {}),
                                                               "simulation"),
                                          opt_out=i in spec.holdouts,
                                          private_epochs=spec.private_epochs, device=spec.device,
                                          backoff_max_s=spec.backoff_max,
                                          attack=attack if i in spec.attackers else AttackConfig(),
                                          **client_tls_options(tls_dir, client_id(i)), **named))
                   for i in range(spec.first, spec.first + spec.count)]
        for c in clients:
            c.start()
        failed = 0
        for c in clients:
            try:
                c.join()
            except Exception as e:  # one client's failure must not hide the others'
                print(f"{c.client_id}: {e}", file=sys.stderr)
                failed += 1
    finished = sum(c.summary.finished for c in clients)
    print(f"host {spec.first}-{spec.first + spec.count - 1}: {finished}/{len(clients)} finished, "
          f"{failed} failed", file=sys.stderr)
    return 0 if finished == len(clients) else 1


def worker_command(spec: HostSpec, path: Path) -> list[str]:
    """Write ``spec`` to ``path`` and return the command line of a worker process that hosts it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(spec)))
    return [sys.executable, "-m", "fedguard.launch", "worker", "--spec", str(path)]


def run_worker(spec_path: str) -> int:
    """The ``worker --spec FILE`` subcommand: a client host as a process of this machine."""
    return host_clients(HostSpec(**json.loads(Path(spec_path).read_text())))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedguard-launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, help="number of clients N (default 10)")
    ap.add_argument("--rounds", type=int, help="rounds R (default: the config's, else 20)")
    ap.add_argument("-k", type=int, help="updates per round K (default: the config's, else N)")
    ap.add_argument("--min-updates", type=int)
    ap.add_argument("--min-available", type=int,
                    help="clients that must be ready before a round starts (default: all N, unless the experiment "
                         "file or --server-set sets rounds.min_available): round 1 then selects from the whole "
                         "fleet, not from the clients that happened to finish their private model first")
    ap.add_argument("--round-timeout", type=float)
    ap.add_argument("--seed", type=int, help="server seed (default: the config's, else 0)")
    ap.add_argument("--config", help="experiment file: server TOML plus an optional [launch] table")
    ap.add_argument("--server-set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--virtual", action="store_true", default=None, help="host many clients per process (threads)")
    ap.add_argument("--procs", type=int, help="client processes in --virtual mode (default 2)")
    ap.add_argument("--trainer", choices=TRAINER_CHOICES,
                    help="the clients' own trainer (default: the server's [recovery] method, flguard unless "
                         "configured; e.g. --server-set recovery.method='ditto')")
    ap.add_argument("--holdouts", type=float,
                    help="fraction of the benign clients that opt out of recovery (vanilla holdouts; default 0)")
    ap.add_argument("--nfl-mode", choices=["detect-and-recover", "always-recover", "off"],
                    help="the server's [nfl] mode (default: the config's, else detect-and-recover)")
    ap.add_argument("--attackers", type=float, help="fraction of clients that attack (default 0)")
    ap.add_argument("--attack", help="attack kind: label_flip, backdoor (data poisoning), model_replacement, "
                                     "stat_opt, dyn_opt (model poisoning); options via the experiment file's "
                                     "[launch.attack] table")
    ap.add_argument("--attack-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an attack option over the experiment file's [launch.attack] table (a TOML value; a bare "
                         "word is a string), e.g. --attack-set dev_type=unit; repeatable")
    ap.add_argument("--knowledge", choices=["partial", "full"],
                    help="model poisoning: attackers estimate the benign statistics from their own data "
                         "(partial, default) or, SIMULATION ONLY, the server-side test harness crafts their "
                         "updates from the round's benign ones (full; needs --insecure)")
    ap.add_argument("--private-epochs", type=int,
                    help="clients train a private model this long first, so beta = V_i - P_i is reported")
    sim = ap.add_argument_group("device simulation (seeded by --seed; fedcore.simulation)")
    sim.add_argument("--straggler", choices=["fixed", "lognormal"], default="fixed",
                     help="straggler delay: fixed, or lognormal with median --straggler-delay")
    sim.add_argument("--straggler-delay", type=float, default=0.0, help="seconds before each upload (default 0)")
    sim.add_argument("--straggler-sigma", type=float, default=1.0, help="log-space standard deviation (lognormal)")
    sim.add_argument("--stragglers", type=float, default=1.0,
                     help="fraction of the clients (seeded) that straggle (default: all, when a delay is set)")
    sim.add_argument("--dropout", type=float, default=0.0,
                     help="per-round probability that a client takes its task and never answers")
    sim.add_argument("--dropout-return", type=float, default=30.0,
                     help="seconds of silence after a dropout before the client comes back (< 0: never)")
    sim.add_argument("--crash", type=float, default=0.0,
                     help="per-round probability that a client crashes after training and re-joins")
    sim.add_argument("--crash-rejoin", type=float, default=5.0, help="seconds from a crash to the re-join")
    sim.add_argument("--availability", metavar="TRACE.json",
                     help="availability trace: JSON object of client id (or \"*\") -> online windows "
                          "[[start_s, end_s], ...] in seconds since the clients started")
    ap.add_argument("--device", help="where clients train: cpu (default), cuda, cuda:N or auto")
    ap.add_argument("--port", type=int, default=0)
    ray = ap.add_argument_group("Ray (pip install fedguard[ray]): client hosts as actors across a Ray cluster")
    ray.add_argument("--ray", metavar="auto|ADDRESS",
                     help="place the --procs client hosts as Ray actors: auto = this machine's Ray cluster (or a "
                          "local instance), else a cluster address; the server stays a process here")
    ray.add_argument("--ray-cpus", type=float, default=1.0, help="CPUs each client host asks Ray for (default 1)")
    ray.add_argument("--ray-gpus", type=float, default=0.0, help="GPUs each client host asks Ray for (default 0)")
    ray.add_argument("--ray-resources", metavar="JSON", help="custom Ray resources per client host, a JSON object")
    ray.add_argument("--server-host", help="address the client hosts reach the server at (default 127.0.0.1; "
                                           "with --ray, this node's address in the Ray cluster)")
    ap.add_argument("--run-dir", default="runs/launch")
    tls = ap.add_mutually_exclusive_group()
    tls.add_argument("--tls-dir", type=Path,
                     help="certificates made with fedguard-certs in the launcher's layout (default: a throw-away "
                          "CA and certificates, mutual TLS)")
    tls.add_argument("--insecure", action="store_true", help="plaintext gRPC instead of mutual TLS")
    ap.add_argument("--resume", action="store_true",
                    help="resume the federation in --run-dir (default: start a new one; the server moves the "
                         "old state to RUN_DIR/previous/)")
    return ap


def _configures_min_available(args: argparse.Namespace) -> bool:
    """Whether the experiment file or a --server-set override sets rounds.min_available itself."""
    if any(item.replace(" ", "").startswith("rounds.min_available=") for item in args.server_set):
        return True
    if args.server_config:
        rounds = json.loads(Path(args.server_config).read_text()).get("rounds", {})
        return "min_available" in rounds
    return False


def attack_table(base: dict[str, Any], attack_set: list[str], kind: str | None,
                 knowledge: str | None) -> dict[str, Any]:
    """The attackers' attack table: the experiment file's ``[launch.attack]``, then each ``--attack-set KEY=VALUE``
    (a TOML value; a bare word is a string), then ``--attack`` and ``--knowledge``. ValueError names the item."""
    from fedcore.config import ConfigError, from_dict, parse_override

    attack = dict(base)
    for item in attack_set:
        try:
            keys, value = parse_override(item)
        except ConfigError as e:
            raise ValueError(f"--attack-set: expected KEY=VALUE, got {item!r}") from e
        if len(keys) != 1:
            raise ValueError(f"--attack-set: expected an attack option KEY=VALUE, got {item!r}")
        attack[keys[0]] = value
    if kind:
        attack["kind"] = kind
    if knowledge:
        attack["knowledge"] = knowledge
    if attack:  # refused here, naming the field, before a server or client starts
        from fedcore.attacks import AttackConfig
        from fedcore.attacks.model_poisoning import check_model_attack

        try:
            check_model_attack(from_dict(AttackConfig, attack, "attack"))
        except (ConfigError, ValueError) as e:
            raise ValueError(f"attack options: {e}") from e
    return attack


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        wp = argparse.ArgumentParser(prog="fedguard-launch worker",
                                     description="host virtual clients described by a HostSpec JSON file")
        wp.add_argument("--spec", required=True, help="JSON object of HostSpec fields")
        return run_worker(wp.parse_args(argv[1:]).spec)
    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    launch_opts: dict[str, Any] = {}
    args.server_config = None
    if args.config:
        launch_opts, args.server_config = split_experiment(args.config, run_dir)
    defaults = {"clients": 10, "virtual": False, "procs": 2, "trainer": "", "attackers": 0.0, "holdouts": 0.0,
                "private_epochs": 0, "rounds": None if args.config else 20, "k": None, "device": "cpu"}
    for key, default in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, launch_opts.get(key, default))
    try:
        attack = attack_table(launch_opts.get("attack", {}), args.attack_set, args.attack, args.knowledge)
    except ValueError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    args.attack = attack
    if attack.get("knowledge") == "full":
        if not args.insecure:
            print("launch: --knowledge full turns on the server's full-knowledge test harness, a simulation "
                  "option refused with (mutual) TLS: add --insecure", file=sys.stderr)
            return 2
        from fedcore.config import toml_literal

        # The harness crafts what the attackers would: the same attack table, on the server.
        args.server_set = [*args.server_set, "simulation_harness.full_knowledge_adversary=true",
                           *(f"simulation_harness.attack.{k}={toml_literal(v)}" for k, v in attack.items())]
    if (args.clients < 1 or (args.rounds is not None and args.rounds < 1) or not 0 <= args.attackers <= 1
            or not 0 <= args.holdouts <= 1):
        print("launch: need --clients >= 1, --rounds >= 1, 0 <= --attackers <= 1 and 0 <= --holdouts <= 1",
              file=sys.stderr)
        return 2
    if args.attackers and attack.get("kind", "none") == "none":
        print("launch: --attackers needs an attack kind (--attack or [launch.attack] kind)", file=sys.stderr)
        return 2
    if args.min_available is None and not _configures_min_available(args):
        args.min_available = args.clients
    try:
        args.simulation = simulation_plan(args)
    except ValueError as e:
        print(f"launch: {e}", file=sys.stderr)
        return 2
    args.simulation_file = run_dir / "simulation.json"
    args.simulation_file.write_text(json.dumps(args.simulation))
    args.attacker_ids = attacker_indices(args.clients, args.attackers, args.seed or 0)
    args.holdout_ids = holdout_indices(args.clients, args.holdouts, args.seed or 0, args.attacker_ids)
    if args.ray:
        try:
            from fedguard.launch_ray import connect, missing_resources, node_address
        except ImportError:
            print("launch: --ray needs Ray: pip install 'fedguard[ray]'", file=sys.stderr)
            return 2
        if args.ray_resources is not None:
            try:
                if not isinstance(json.loads(args.ray_resources), dict):
                    raise ValueError
            except ValueError:
                print("launch: --ray-resources must be a JSON object of resource name -> amount", file=sys.stderr)
                return 2
        connect(args.ray)
        per_host = math.ceil(args.clients / max(args.procs, 1))
        why = missing_resources(args, math.ceil(args.clients / per_host))
        if why is not None:
            print(f"launch: {why}", file=sys.stderr)
            return 2
        args.virtual = True
        args.server_host = args.server_host or node_address()
    args.server_host = args.server_host or "127.0.0.1"
    t0 = time.monotonic()
    made_tls = None
    if not args.insecure and args.tls_dir is None:
        made_tls = args.tls_dir = make_tls_dir([client_id(i) for i in range(args.clients)],
                                               server_hosts=(args.server_host, "127.0.0.1", "localhost"))
    try:
        return _launch(args, run_dir, t0)
    finally:
        if made_tls is not None:
            shutil.rmtree(made_tls, ignore_errors=True)


def _launch(args: argparse.Namespace, run_dir: Path, t0: float) -> int:
    launch = start(args, run_dir)
    mode = (f"{len(launch.clients)} Ray actors" if args.ray else
            f"virtual, {len(launch.clients)} processes" if args.virtual else "one process each")
    attack_note = (f", {len(args.attacker_ids)} attackers ({args.attack.get('kind')})" if args.attacker_ids
                   else "")
    if args.holdout_ids:
        attack_note += f", {len(args.holdout_ids)} holdouts"
    transport = "plaintext" if args.tls_dir is None else "mutual TLS"
    print(f"fedguard: server {launch.address} ({transport}), {args.clients} clients ({mode}){attack_note}, "
          f"{args.rounds or 'configured'} rounds, logs in {run_dir}/", flush=True)
    try:
        rc = watch(launch, run_dir, tls_dir=args.tls_dir)
    except KeyboardInterrupt:
        launch.server.terminate()
        rc = launch.server.wait()
    codes = finish(launch)
    bad = [i for i, c in enumerate(codes) if c != 0]
    print(f"server exit {rc}; client hosts ok {len(codes) - len(bad)}/{len(codes)}; "
          f"wall {time.monotonic() - t0:.1f} s; final model {run_dir / 'final_model.fgt'}", flush=True)
    if rc != 0:
        with contextlib.suppress(OSError):
            tail = (run_dir / "server.log").read_text().splitlines()[-5:]
            print("server log tail:\n  " + "\n  ".join(tail), file=sys.stderr)
    return rc if rc != 0 else (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
