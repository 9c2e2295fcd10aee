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
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from fedcore.about import VersionAction
from fedcore.names import ATTACKS, DATASETS, DETECTORS, MODELS, NFL_MODES, RULES, TRAINERS, one_of
from fedcore.report import RoundReport  # no torch: --help stays fast

COLUMNS = ("round", "selected", "accepted", "rejected", "late", "abandoned", "train_loss", "test_acc", "beta_hat",
           "beta", "beta_b", "delta", "adapt", "nfl", "clusters", "dp_eps", "seconds")
_WIDTHS = (5, 8, 8, 8, 4, 9, 10, 8, 8, 7, 7, 8, 5, 12, 8, 8, 8)
LAUNCH_KEYS = {"clients", "virtual", "procs", "attackers", "attack", "private_epochs", "rounds", "k", "trainer",
               "device", "holdouts"}
TRAINER_CHOICES = TRAINERS  # the trainer registry's names (fedcore.names: no torch for --help)


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
    without DistFL or before the first clustering), delta LINDT's Delta = w_div - ||noise||, dp_eps the cumulative
    epsilon of server-side DP ("-" when not accounted; docs/privacy.md)."""
    nfl = h.nfl if h.nfl in ("off", "always") else f"{h.nfl}:{h.nfl_count}"
    if h.recovery and h.nfl == "watching":
        nfl += "+rec"  # long-term recovery carries on after a cancel
    return (f"{h.round:>5} {h.selected:>8} {h.accepted:>8} {h.rejected:>8} {h.late_total:>4} {h.attempt:>9} "
            f"{_fmt(h.mean_train_loss):>10} "
            f"{_fmt(h.mean_test_accuracy):>8} {_fmt(h.beta_hat, 3):>8} {_fmt(h.beta, 3):>7} "
            f"{_fmt(h.beta_benign, 3):>7} {_fmt(h.metrics.get('delta', math.nan), 3):>8} {h.adapting:>5} {nfl:>12} "
            f"{len(h.clusters) or '-':>8} {_eps(h.dp_epsilon):>8} {h.seconds:>8.3f}")


def _eps(v: float) -> str:
    """epsilon in 8 columns: 3 decimals while small, scientific notation when the noise gives no real privacy."""
    if v != v:
        return "-"
    return f"{v:.3f}" if v < 1000 else f"{v:.2e}"


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


def split_experiment(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read an experiment file: its ``[launch]`` table and the server part. :class:`ConfigError` names an unknown
    ``[launch]`` key and the known ones."""
    from fedcore.config import ConfigError, load_toml

    data = load_toml(path)
    launch = data.pop("launch", {})
    if not isinstance(launch, dict):
        raise ConfigError("launch", f"expected a table, got {launch!r}")
    for key in sorted(set(launch) - LAUNCH_KEYS):
        raise ConfigError(f"launch.{key}", f"unknown field; known: {', '.join(sorted(LAUNCH_KEYS))}")
    return dict(launch), data


def client_id(index: int) -> str:
    return f"client-{index:05d}"


STATUS_CLIENT = "launcher"
# The operator credential of the servers this launcher starts (GetStatus is operator-only): random per launcher
# process, handed to the server in its environment (FEDGUARD_OPERATOR_TOKEN), never on a command line, in the
# run dir or in a log.
OPERATOR_TOKEN = secrets.token_urlsafe(24)


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
    ``wait`` raises :class:`subprocess.TimeoutExpired` when the host is still running after ``timeout``; ``poll``
    is its exit status, None while it runs."""

    def wait(self, timeout: float | None = None) -> int: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class Launch:
    server: subprocess.Popen[bytes]
    clients: list[Host]
    address: str
    logs: list[IO[bytes]]
    # The log file of each client host (None for a Ray actor: it logs to Ray's session directory).
    client_logs: list[Path | None] = field(default_factory=list)
    server_log: Path | None = None


# Launcher options that define the federation: changing one on --resume is refused, naming it.
FEDERATION_OPTIONS = ("clients", "k", "seed", "config", "server_set", "attackers", "attack", "attack_set",
                      "knowledge", "holdouts", "trainer", "private_epochs", "min_updates")
LAUNCH_FILE = "launch.json"
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped (or killed) by Ctrl-C or SIGTERM; resumable
# Dataset options that are paths or local choices: a server never announces them, so the launcher hands them
# to its clients itself (the clients then read the data the configuration names, never another copy).
LOCAL_DATA_OPTIONS = ("data_dir", "path", "source", "cache_dir", "download")


def server_command(args: argparse.Namespace, run_dir: Path, listen: str, tls_dir: Path | None,
                   server_config: Path | None) -> list[str]:
    """The ``fedserver`` command line of this launch (``server_config``: the experiment file's server part)."""
    cmd = [sys.executable, "-m", "fedserver", "--address", listen, "--run-dir", str(run_dir), "--log-json",
           "--linger", "30", *server_tls_flags(tls_dir)]
    for flag, value in (("--rounds", args.rounds), ("-k", args.k), ("--seed", args.seed)):
        if value is not None:
            cmd += [flag, str(value)]
    if server_config is not None:
        cmd += ["--config", str(server_config)]
    if args.k is None and not args.server_part:
        cmd += ["-k", str(args.clients)]
    if args.min_updates is not None:
        cmd += ["--min-updates", str(args.min_updates)]
    if args.min_available is not None:
        cmd += ["--min-available", str(args.min_available)]
    if args.round_timeout is not None:
        cmd += ["--round-timeout", str(args.round_timeout)]
    if args.nfl_mode is not None:
        cmd += ["--nfl-mode", args.nfl_mode]
    for item in args.server_set:
        cmd += ["--set", item]
    if not args.resume:
        cmd.append("--fresh")
    return cmd


def resolve_server_config(args: argparse.Namespace) -> Any:
    """The :class:`fedcore.config.ServerConfig` the server of this launch will run, built in-process from the same
    command line (the transport is the launcher's own making, so it is left out here)."""
    from fedserver.cli import build_parser as server_parser
    from fedserver.cli import config_from_args

    with tempfile.TemporaryDirectory(prefix="fedguard-launch-check-") as tmp:
        part = None
        if args.server_part:
            part = Path(tmp) / "server_config.json"
            part.write_text(json.dumps(args.server_part))
        cmd = server_command(args, Path(tmp) / "run", "127.0.0.1:0", None, part)
        return config_from_args(server_parser().parse_args(cmd[3:]))


def preflight(args: argparse.Namespace) -> Any:
    """Check the whole configuration in-process before anything starts: the server's (fields, data present,
    model on one sample, K and min_available against the fleet) and the clients' (trainer, threads, data
    folder). Returns the server configuration; :class:`fedcore.config.ConfigError` names the field."""
    from fedcore.config import ClientConfig, ConfigError
    from fedcore.preflight import check_fleet, check_server_config

    if args.procs is not None and args.procs < 1:
        raise ConfigError("--procs", f"must be >= 1, got {args.procs}")
    if args.torch_threads is not None and args.torch_threads < 0:
        raise ConfigError("--torch-threads", f"must be >= 0, got {args.torch_threads}")
    if args.k is not None and not 1 <= args.k <= args.clients:
        raise ConfigError("rounds.clients_per_round", f"-k {args.k} must be in [1, --clients {args.clients}] (K "
                                                      f"updates per round out of {args.clients} clients)")
    if args.min_available is not None and not _configures_min_available(args):
        # K from the experiment file against the fleet first: the launcher's min_available = N would hide it
        check_fleet(resolve_server_config(argparse.Namespace(**{**vars(args), "min_available": None})),
                    args.clients)
    config = resolve_server_config(args)
    check_server_config(config, num_clients=args.clients)
    ClientConfig(trainer=args.trainer or "", private_epochs=args.private_epochs, device=args.device,
                 insecure=True).validate()
    return config


def local_data_options(server_part: dict[str, Any], server_set: list[str]) -> dict[str, Any]:
    """The local dataset options (``data_dir``, ...) of the server configuration, which clients get from the
    launcher (a server never announces paths)."""
    from fedcore.config import merge_override, parse_override

    data: dict[str, Any] = json.loads(json.dumps(server_part))
    for item in server_set:
        keys, value = parse_override(item)
        merge_override(data, keys, value)
    options = data.get("data", {}).get("options", {})
    return {k: options[k] for k in LOCAL_DATA_OPTIONS if isinstance(options, dict) and k in options}


def start(args: argparse.Namespace, run_dir: Path) -> Launch:
    from fedcore.config import toml_literal

    port = args.port or _free_port()
    # With Ray, hosts on other machines reach the server at --server-host (default: this node's IP).
    address = f"{args.server_host}:{port}"
    listen = f"0.0.0.0:{port}" if args.ray else address
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.torch_threads), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    server_config = None
    if args.server_part:
        server_config = run_dir / "server_config.json"
        server_config.write_text(json.dumps(args.server_part, indent=2))
    server_cmd = server_command(args, run_dir, listen, args.tls_dir, server_config)
    mode = "ab" if args.resume else "wb"
    logs: list[IO[bytes]] = []
    slog = open(run_dir / "server.log", mode)  # noqa: SIM115 (closed in finish())
    logs.append(slog)
    # Every child in a session of its own: a terminal's Ctrl-C reaches the launcher only, which stops them in order.
    server = subprocess.Popen(server_cmd, stdout=slog, stderr=subprocess.STDOUT,
                              env={**env, "OMP_NUM_THREADS": "1", "FEDGUARD_OPERATOR_TOKEN": OPERATOR_TOKEN},
                              start_new_session=True)
    clients: list[Host] = []
    client_logs: list[Path | None] = []
    procs = args.procs if args.virtual else args.clients
    per_proc = math.ceil(args.clients / max(procs, 1))
    if args.ray:
        from fedguard.launch_ray import start_ray_hosts

        specs = [host_spec(args, address, first, min(per_proc, args.clients - first), ship_tls=True)
                 for first in range(0, args.clients, per_proc)]
        clients.extend(start_ray_hosts(args, specs))
        return Launch(server, clients, address, logs, [None] * len(clients), run_dir / "server.log")
    for p in range(procs):
        first = p * per_proc
        count = min(per_proc, args.clients - first)
        if count <= 0:
            break
        log_path = run_dir / f"clients-{p}.log"
        clog = open(log_path, mode)  # noqa: SIM115
        logs.append(clog)
        if args.virtual:
            cmd = worker_command(host_spec(args, address, first, count), run_dir / "hosts" / f"host-{p}.json")
        else:
            cmd = [py, "-m", "fedclient", "--server", address, "--client-id", client_id(first),
                   "--data-index", str(first), "--trainer", args.trainer, "--torch-threads", str(args.torch_threads),
                   "--log-json", "--log-level", "warning",
                   "--private-epochs", str(args.private_epochs), "--device", args.device,
                   *client_tls_flags(args.tls_dir, client_id(first))]
            if args.data_options:
                cmd += ["--data-options", json.dumps(args.data_options)]
            if first in args.attacker_ids:
                cmd += [item for k, v in args.attack.items() for item in ("--set", f"attack.{k}={toml_literal(v)}")]
            if first in args.holdout_ids:
                cmd.append("--opt-out")
            sim = args.simulation.get(client_id(first), {})
            cmd += [item for k, v in sim.items() for item in ("--set", f"simulation.{k}={toml_literal(v)}")]
        clients.append(subprocess.Popen(cmd, stdout=clog, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        client_logs.append(log_path)
    return Launch(server, clients, address, logs, client_logs, run_dir / "server.log")


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
        tls_dir="" if ship_tls or args.tls_dir is None else str(args.tls_dir), tls_files=tls_files,
        torch_threads=args.torch_threads, data_options=dict(args.data_options))


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


def _ended_by_dp_budget(log: Path, max_bytes: int = 64 << 10) -> bool:
    """The server's last ``federation.finished`` event says its DP budget was spent (outcome ``dp_budget``)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return False
    finished = [line for line in lines if '"federation.finished"' in line]
    return bool(finished) and '"dp_budget"' in finished[-1]


def last_error(log: Path, max_bytes: int = 256 << 10) -> str:
    """A process's last error from its log: the exception line of its last traceback, its last line from a CLI
    (``fedserver: ...``, ``fedclient: ...``), and its last error-level JSON log event; "" when there is none."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    exception = cli = event = ""
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
            continue
        if in_traceback and line and not line.startswith((" ", "\t")):
            exception, in_traceback = line.strip(), line.startswith("During handling")
            continue
        if line.startswith(("fedserver: ", "fedclient: ", "launch: ")) and "note:" not in line:
            cli = line.strip()
        elif line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                fields = " ".join(f"{k}={v}" for k, v in record.items()
                                  if k not in ("event", "level", "timestamp", "component"))
                event = f"{record.get('event')} {fields}".strip()
    parts = [p for p in (cli, exception if exception not in cli else "", f"log event: {event}" if event else "")
             if p]
    return "\n".join(parts)


def vanished_count(log: Path | None) -> int:
    """Clients of a host that left on purpose (simulated dropout or availability), from the host's log."""
    if log is None:
        return 0
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return 0
    import re

    hosted = [int(m) for m in re.findall(r"^host \d+-\d+: \d+/\d+ finished, (\d+) vanished", text, re.M)]
    return hosted[-1] if hosted else text.count("vanished (simulated device)")


class Interrupts:
    """SIGINT/SIGTERM while the launcher runs: the first asks for a graceful stop, the second for a kill."""

    def __init__(self) -> None:
        self.count = 0
        self.first_at: float | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1  # nothing printed here: a signal handler that writes can interrupt another write
        if self.first_at is None:
            self.first_at = time.monotonic()

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)


class Progress:
    """A one-line progress indicator with an ETA on a terminal; plain lines, at most every ``plain_every`` s,
    otherwise."""

    def __init__(self, out: IO[str], plain_every: float = 30.0) -> None:
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.plain_every = plain_every
        self.last_plain = time.monotonic()
        self.shown = False

    def show(self, text: str) -> None:
        if self.tty:
            print(f"\r\x1b[2K{text}", end="", file=self.out, flush=True)
            self.shown = True
        elif time.monotonic() - self.last_plain >= self.plain_every:
            print(text, file=self.out, flush=True)
            self.last_plain = time.monotonic()

    def clear(self) -> None:
        if self.shown:
            print("\r\x1b[2K", end="", file=self.out, flush=True)
            self.shown = False


def eta(done: float, total: float, elapsed: float) -> str:
    """``ETA 1m05s`` from the rate so far ("ETA -" before any progress)."""
    if done <= 0 or total <= done:
        return "ETA -" if total > done else "ETA 0s"
    left = elapsed / done * (total - done)
    return f"ETA {int(left // 60)}m{int(left % 60):02d}s" if left >= 60 else f"ETA {left:.0f}s"


def _waiting(run_dir: Path) -> tuple[int, int] | None:
    """The server's last ``round.waiting`` event (ready, needed) from its JSON log, if any."""
    try:
        with open(run_dir / "server.log", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (64 << 10)))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"round.waiting"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                return int(record["ready"]), int(record["needed"])
    return None


@dataclass
class Outcome:
    """How a launch ended."""

    server_rc: int | None
    # "finished", "failed" (a process exited with an error), "stopped" (first Ctrl-C), "killed" (second Ctrl-C)
    how: str
    failed: str = ""
    history: list[RoundReport] = field(default_factory=list)


def watch(launch: Launch, run_dir: Path, interval: float = 0.1, out: IO[str] = sys.stdout,
          tls_dir: Path | None = None, interrupts: Interrupts | None = None, num_rounds: int = 0,
          graceful_s: float = 3.0) -> Outcome:
    """Print each completed round as the server reports it (one line each) until the server exits, a process
    fails (its last error printed at once, the federation stopped), or an interrupt stops it."""
    import grpc

    from fedclient.transport import open_channel
    from fedcore.config import ClientConfig
    from fedguard import wire
    from fedguard.v1 import fedguard_pb2 as pb
    from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

    channel = open_channel(ClientConfig(server=launch.address, **client_tls_options(tls_dir, STATUS_CLIENT)))
    stub = pb_grpc.FederationStub(channel)  # type: ignore[no-untyped-call]
    history: list[RoundReport] = []
    progress = Progress(out)
    interrupts = interrupts or Interrupts()
    print(format_header(), file=out, flush=True)
    t_start = time.monotonic()
    t_first_round: float | None = None
    first_round = 0  # the first round this launcher saw complete (a resumed run starts later)
    total = num_rounds
    next_poll = 0.0
    try:
        while True:
            rc = launch.server.poll()
            if interrupts.count:
                progress.clear()
                print("\nlaunch: stopping: the server saves the federation, clients leave (Ctrl-C again kills "
                      "everything at once)", file=sys.stderr, flush=True)
                return stop_gracefully(launch, interrupts, graceful_s, history)
            failed = _failed_client(launch)
            if failed is not None and rc is None:
                progress.clear()
                print(f"launch: {failed}", file=sys.stderr, flush=True)
                stop_now(launch)
                return Outcome(launch.server.poll(), "failed", failed, history)
            now = time.monotonic()
            if now >= next_poll or rc is not None:
                next_poll = now + 0.5
                try:
                    st = wire.status_from_pb(stub.GetStatus(pb.StatusRequest(), timeout=1.0,
                                                            metadata=[("fg-operator", OPERATOR_TOKEN)]))
                    total = st.num_rounds or total
                    last = history[-1].round if history else 0
                    for h in st.history:
                        if h.round > last:
                            progress.clear()
                            print(format_row(h), file=out, flush=True)
                            history.append(h)
                            if t_first_round is None:
                                t_first_round, first_round = now, h.round
                except grpc.RpcError:
                    pass
            if rc is not None:
                progress.clear()
                # Rounds that completed after the last poll are in the server's rounds.jsonl.
                for h in _jsonl_rows(run_dir, history[-1].round if history else 0):
                    print(format_row(h), file=out, flush=True)
                    history.append(h)
                if history:
                    print(last_rounds_summary(history), file=out, flush=True)
                return Outcome(rc, "finished" if rc == 0 else "failed", "", history)
            if not history:
                waiting = _waiting(run_dir)
                if waiting is not None:
                    ready, needed = waiting
                    progress.show(f"round 1 waits for clients (private models, joins): {ready}/{needed} ready, "
                                  f"{now - t_start:.0f} s, {eta(ready, needed, now - t_start)}")
            elif total and t_first_round is not None:
                done = history[-1].round
                progress.show(f"round {done}/{total} done, {now - t_start:.0f} s, "
                              f"{eta(done - first_round, total - first_round, now - t_first_round)}")
            time.sleep(interval)
    finally:
        channel.close()


def _failed_client(launch: Launch) -> str | None:
    """The first client host that exited with an error: its number, exit status and last error."""
    for i, c in enumerate(launch.clients):
        code = c.poll()
        if code not in (None, 0):
            log = launch.client_logs[i] if i < len(launch.client_logs) else None
            detail = last_error(log) if log is not None else ""
            where = f" ({log})" if log is not None else ""
            return f"client host {i} exited with status {code}{where}" + (
                "\n  " + detail.replace("\n", "\n  ") if detail else "")
    return None


def _signal_all(launch: Launch, sig: int) -> None:
    procs: list[Any] = [launch.server, *launch.clients]
    for p in procs:
        if not isinstance(p, subprocess.Popen):
            if sig == signal.SIGKILL:
                p.kill()
            continue
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)


def stop_now(launch: Launch) -> None:
    """Stop the federation after a failure: the server gracefully (it saves the state), clients at once."""
    with contextlib.suppress(ProcessLookupError):
        launch.server.send_signal(signal.SIGTERM)
    for c in launch.clients:
        c.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        launch.server.wait(5.0)
    if launch.server.poll() is None:
        _signal_all(launch, signal.SIGKILL)


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _logged_since(path: Path | None, offset: int, needle: str) -> bool:
    """Whether ``needle`` was written to ``path`` after byte ``offset``."""
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return needle.encode() in f.read()
    except OSError:
        return False


def stop_gracefully(launch: Launch, interrupts: Interrupts, graceful_s: float,
                    history: list[RoundReport], server_patience_s: float = 10.0) -> Outcome:
    """First Ctrl-C: SIGTERM to every child (the server saves the federation and tells polling clients to come
    back later; clients leave). The server is done when it has exited or logged ``server.stopped`` (its state is
    saved; what is left is the interpreter's teardown); clients get at most 1 s more, everything at most
    ``graceful_s`` from the interrupt, the server itself at most ``server_patience_s`` to save. What still runs
    then is killed. A second Ctrl-C kills at once."""
    offset = _size(launch.server_log)
    _signal_all(launch, signal.SIGTERM)
    start = interrupts.first_at or time.monotonic()
    server_done: float | None = None
    while interrupts.count < 2:
        now = time.monotonic()
        if server_done is None and (launch.server.poll() is not None
                                    or _logged_since(launch.server_log, offset, '"server.stopped"')):
            server_done = now
        clients_done = all(c.poll() is not None for c in launch.clients)
        if server_done is not None and ((clients_done and launch.server.poll() is not None)
                                        or now > min(server_done + 1.0, start + graceful_s)):
            break
        if server_done is None and now > start + server_patience_s:
            break
        time.sleep(0.02)
    how = "killed" if interrupts.count >= 2 else "stopped" if server_done is not None else "stopped-unsaved"
    _signal_all(launch, signal.SIGKILL)  # whatever is still running
    launch.server.wait()
    for c in launch.clients:  # reaped: gone when the launcher returns
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.wait(5.0)
    return Outcome(launch.server.returncode, how, "", history)


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


def finish(launch: Launch, timeout: float = 30.0, interrupts: Interrupts | None = None) -> list[int | None]:
    """Wait for the client hosts (at most ``timeout`` s in all, or until an interrupt; those still running are
    terminated) and close the logs."""
    deadline = time.monotonic() + timeout
    while (time.monotonic() < deadline and any(c.poll() is None for c in launch.clients)
           and not (interrupts and interrupts.count)):
        time.sleep(0.05)
    codes: list[int | None] = []
    for c in launch.clients:
        code = c.poll()
        if code is None:
            c.terminate()
        codes.append(code)
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
    # torch intra-op threads of the host process (the launcher: max(1, cores // client processes)).
    torch_threads: int = 1
    # The clients' own dataset options (data_dir, ...: what a server never announces).
    data_options: dict[str, Any] = field(default_factory=dict)


def host_clients(spec: HostSpec, stop: threading.Event | None = None) -> int:
    """Host the spec's virtual clients (threads, one gRPC channel each) in this process until the federation
    ends (or ``stop`` is set: every client leaves); 0 when every one of them finished or vanished on purpose
    (simulated dropout or availability)."""
    import torch

    from fedclient import ClientConfig, FedClient
    from fedcore.attacks import AttackConfig
    from fedcore.config import from_dict
    from fedcore.log import configure_logging
    from fedcore.simulation import SimulationConfig

    torch.set_num_threads(max(1, spec.torch_threads))
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
                                          backoff_max_s=spec.backoff_max, data_options=dict(spec.data_options),
                                          attack=attack if i in spec.attackers else AttackConfig(),
                                          **client_tls_options(tls_dir, client_id(i)), **named))
                   for i in range(spec.first, spec.first + spec.count)]
        for c in clients:
            c.start()
        if stop is not None:
            def stop_all() -> None:
                stop.wait()
                for c in clients:
                    threading.Thread(target=c.stop, daemon=True).start()

            threading.Thread(target=stop_all, daemon=True).start()
        failed = 0
        for c in clients:
            try:
                c.join()
            except Exception as e:  # one client's failure must not hide the others'
                print(f"{c.client_id}: {e}", file=sys.stderr)
                failed += 1
    finished = sum(c.summary.finished for c in clients)
    vanished = sum(c.summary.vanished and not c.summary.finished for c in clients)
    print(f"host {spec.first}-{spec.first + spec.count - 1}: {finished}/{len(clients)} finished, "
          f"{vanished} vanished (simulated device), {failed} failed", file=sys.stderr)
    stopped = stop is not None and stop.is_set()
    return 0 if failed == 0 and (stopped or finished + vanished == len(clients)) else 1


def worker_command(spec: HostSpec, path: Path) -> list[str]:
    """Write ``spec`` to ``path`` and return the command line of a worker process that hosts it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(spec)))
    return [sys.executable, "-m", "fedguard.launch", "worker", "--spec", str(path)]


def run_worker(spec_path: str) -> int:
    """The ``worker --spec FILE`` subcommand: a client host as a process of this machine; SIGTERM or SIGINT
    makes its clients leave."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    return host_clients(HostSpec(**json.loads(Path(spec_path).read_text())), stop)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedguard-launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=VersionAction)
    ap.add_argument("--clients", type=int, help="number of clients N (default 10)")
    ap.add_argument("--rounds", type=int, help="rounds R (default: the config's, else 20)")
    ap.add_argument("-k", type=int, help="updates per round K (default: the config's, else N)")
    ap.add_argument("--min-updates", type=int,
                    help="updates that suffice when a round closes early or at its deadline (default: half of K "
                         "rounded up, raised to what the aggregation rule needs); must be <= K")
    ap.add_argument("--min-available", type=int,
                    help="clients that must be ready before a round starts (default: all N, unless the experiment "
                         "file or --server-set sets rounds.min_available): round 1 then selects from the whole "
                         "fleet, not from the clients that happened to finish their private model first")
    ap.add_argument("--round-timeout", type=float)
    ap.add_argument("--seed", type=int, help="server seed (default: the config's, else 0)")
    ap.add_argument("--config", help="experiment file: server TOML plus an optional [launch] table")
    ap.add_argument("--server-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="any server configuration field (a TOML value), e.g. model.name (" + one_of(MODELS) +
                         "), data.dataset (" + one_of(DATASETS) + "), aggregation.rule (" + one_of(RULES) +
                         "), nfl.detector (" + one_of(DETECTORS) + "); repeatable")
    ap.add_argument("--virtual", action="store_true", default=None, help="host many clients per process (threads)")
    ap.add_argument("--procs", type=int, help="client processes in --virtual mode (default 2)")
    ap.add_argument("--trainer", choices=TRAINER_CHOICES,
                    help="the clients' own trainer (default: the server's [recovery] method, flguard unless "
                         "configured; e.g. --server-set recovery.method='ditto')")
    ap.add_argument("--holdouts", type=float,
                    help="fraction of the benign clients that opt out of recovery (vanilla holdouts; default 0)")
    ap.add_argument("--nfl-mode", choices=NFL_MODES,
                    help="the server's [nfl] mode (default: the config's, else detect-and-recover)")
    ap.add_argument("--attackers", type=float, help="fraction of clients that attack (default 0)")
    ap.add_argument("--attack", choices=ATTACKS,
                    help="attack kind: label_flip, backdoor (data poisoning), model_replacement, stat_opt, dyn_opt "
                         "(model poisoning); options via the experiment file's [launch.attack] table or --attack-set")
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
    ap.add_argument("--torch-threads", type=int,
                    help="torch threads of each client process (default: max(1, cores // client processes), so "
                         "co-hosted clients do not fight over the cores; with --ray: --ray-cpus)")
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
                    help="resume the federation in --run-dir with the launcher arguments saved there "
                         f"(RUN_DIR/{LAUNCH_FILE}): flags given again override them, one that would change the "
                         "federation is refused (default: start a new one; the server moves the old state to "
                         "RUN_DIR/previous/)")
    return ap


def _configures_min_available(args: argparse.Namespace) -> bool:
    """Whether the experiment file or a --server-set override sets rounds.min_available itself."""
    if any(item.replace(" ", "").startswith("rounds.min_available=") for item in args.server_set):
        return True
    rounds = (args.server_part or {}).get("rounds", {})
    return isinstance(rounds, dict) and "min_available" in rounds


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


def given_options(argv: list[str]) -> dict[str, Any]:
    """The options given on this command line (dest -> value), without the parser's defaults."""
    ap = build_parser()
    for action in ap._actions:
        action.default = argparse.SUPPRESS
    return vars(ap.parse_args(argv))


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def resume_arguments(run_dir: Path, given: dict[str, Any]) -> dict[str, Any]:
    """The launcher arguments saved in ``RUN_DIR/launch.json`` with this command line's flags over them; a flag
    that would change the federation (:data:`FEDERATION_OPTIONS`) is a :class:`ConfigError` naming it."""
    from fedcore.config import ConfigError

    saved: dict[str, Any] = json.loads((run_dir / LAUNCH_FILE).read_text())["arguments"]
    defaults = _jsonable(vars(build_parser().parse_args([])))
    for key in FEDERATION_OPTIONS:
        if key not in given:
            continue
        was, now = saved.get(key, defaults.get(key)), _jsonable(given[key])
        if was != now:
            flag = "-k" if key == "k" else "--" + key.replace("_", "-")
            raise ConfigError(flag, f"was {was!r} when this federation started, now {now!r}: resuming would change "
                                    f"the federation; leave the flag out (the saved value is used) or start a new "
                                    f"federation without --resume")
    return {**saved, **_jsonable({k: v for k, v in given.items() if k != "resume"})}


def save_arguments(args: argparse.Namespace, run_dir: Path, names: list[str]) -> None:
    """The launcher's resolved arguments into ``RUN_DIR/launch.json`` (for ``--resume --run-dir RUN``)."""
    arguments = {name: getattr(args, name) for name in names if name != "resume"}
    (run_dir / LAUNCH_FILE).write_text(json.dumps({"arguments": _jsonable(arguments)}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        wp = argparse.ArgumentParser(prog="fedguard-launch worker",
                                     description="host virtual clients described by a HostSpec JSON file")
        wp.add_argument("--spec", required=True, help="JSON object of HostSpec fields")
        return run_worker(wp.parse_args(argv[1:]).spec)
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    from fedcore.config import ConfigError

    try:
        rc = _main(args, given_options(argv), t0)
    except ConfigError as e:
        print(f"launch: configuration error: {e}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        print("launch: interrupted before the federation started; nothing runs", file=sys.stderr)
        rc = EXIT_INTERRUPTED
    if as_program and rc in (2, EXIT_INTERRUPTED) and "ray" not in sys.modules:
        # A refused configuration (nothing started) or a Ctrl-C stop (every child gone, the logs closed, the
        # certificates removed): skip the interpreter's teardown (torch's and gRPC's take seconds on a loaded
        # machine) and return at once. Ray's own exit handlers, when it was used, still run.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _main(args: argparse.Namespace, given: dict[str, Any], t0: float) -> int:
    """Resolve the arguments (``--resume``: the saved ones), check everything, then launch."""
    from fedcore.config import ConfigError

    run_dir = Path(args.run_dir)
    names = list(vars(build_parser().parse_args([])))
    if args.resume and (run_dir / LAUNCH_FILE).exists():
        for key, value in resume_arguments(run_dir, given).items():
            if key in names:
                setattr(args, key, Path(value) if key == "tls_dir" and value else value)
        args.resume = True
    launch_opts: dict[str, Any] = {}
    args.server_part = {}
    if args.config:
        launch_opts, args.server_part = split_experiment(args.config)
    defaults = {"clients": 10, "virtual": False, "procs": 2, "trainer": "", "attackers": 0.0, "holdouts": 0.0,
                "private_epochs": 0, "rounds": None if args.config else 20, "k": None, "device": "cpu"}
    for key, default in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, launch_opts.get(key, default))
    resolved = {name: getattr(args, name) for name in names}
    if args.clients < 1:
        raise ConfigError("--clients", f"must be >= 1, got {args.clients}")
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError("--rounds", f"must be >= 1, got {args.rounds}")
    for name in ("attackers", "holdouts"):
        if not 0 <= getattr(args, name) <= 1:
            raise ConfigError(f"--{name}", f"must be a fraction in [0, 1], got {getattr(args, name)}")
    try:
        attack = attack_table(launch_opts.get("attack", {}), args.attack_set, args.attack, args.knowledge)
    except ValueError as e:
        raise ConfigError("attack", str(e).removeprefix("attack options: ")) from None
    args.attack = attack
    if attack.get("knowledge") == "full":
        if not args.insecure:
            raise ConfigError("--knowledge", "full turns on the server's full-knowledge test harness, a simulation "
                                             "option refused with (mutual) TLS: add --insecure")
        from fedcore.config import toml_literal

        # The harness crafts what the attackers would: the same attack table, on the server.
        args.server_set = [*args.server_set, "simulation_harness.full_knowledge_adversary=true",
                           *(f"simulation_harness.attack.{k}={toml_literal(v)}" for k, v in attack.items())]
    if args.attackers and attack.get("kind", "none") == "none":
        raise ConfigError("--attackers", f"needs an attack kind: --attack {one_of(ATTACKS[1:])} (or [launch.attack] "
                                         "kind)")
    if args.min_available is None and not _configures_min_available(args):
        args.min_available = args.clients
    try:
        args.simulation = simulation_plan(args)
    except ValueError as e:
        raise ConfigError("simulation", str(e)) from None
    args.attacker_ids = attacker_indices(args.clients, args.attackers, args.seed or 0)
    args.holdout_ids = holdout_indices(args.clients, args.holdouts, args.seed or 0, args.attacker_ids)
    args.data_options = local_data_options(args.server_part, args.server_set)
    if args.torch_threads is None or args.torch_threads == 0:
        from fedcore.cores import threads_per_process

        processes = (math.ceil(args.clients / math.ceil(args.clients / max(args.procs, 1))) if args.virtual or args.ray
                     else args.clients)
        args.torch_threads = (max(1, int(args.ray_cpus)) if args.ray
                              else threads_per_process(processes) if args.procs >= 1 else 1)
    config = preflight(args)  # everything, in-process, before a single process starts
    if args.ray:
        try:
            from fedguard.launch_ray import connect, missing_resources, node_address
        except ImportError:
            raise ConfigError("--ray", "needs Ray: pip install 'fedguard[ray]'") from None
        if args.ray_resources is not None:
            try:
                if not isinstance(json.loads(args.ray_resources), dict):
                    raise ValueError
            except ValueError:
                raise ConfigError("--ray-resources", "must be a JSON object of resource name -> amount") from None
        connect(args.ray)
        per_host = math.ceil(args.clients / max(args.procs, 1))
        why = missing_resources(args, math.ceil(args.clients / per_host))
        if why is not None:
            raise ConfigError("--ray", why)
        args.virtual = True
        args.server_host = args.server_host or node_address()
    args.server_host = args.server_host or "127.0.0.1"
    run_dir.mkdir(parents=True, exist_ok=True)
    save_arguments(argparse.Namespace(**resolved), run_dir, names)
    args.simulation_file = run_dir / "simulation.json"
    args.simulation_file.write_text(json.dumps(args.simulation))
    made_tls = None
    if not args.insecure and args.tls_dir is None:
        made_tls = args.tls_dir = make_tls_dir([client_id(i) for i in range(args.clients)],
                                               server_hosts=(args.server_host, "127.0.0.1", "localhost"))
    try:
        return _launch(args, run_dir, t0, config.rounds.num_rounds)
    finally:
        if made_tls is not None:
            shutil.rmtree(made_tls, ignore_errors=True)


def resume_command(run_dir: Path) -> str:
    import shlex

    return f"fedguard-launch --resume --run-dir {shlex.quote(str(run_dir))}"


def _launch(args: argparse.Namespace, run_dir: Path, t0: float, num_rounds: int) -> int:
    interrupts = Interrupts()
    interrupts.install()
    launch = start(args, run_dir)
    mode = (f"{len(launch.clients)} Ray actors" if args.ray else
            f"virtual, {len(launch.clients)} processes" if args.virtual else "one process each")
    attack_note = (f", {len(args.attacker_ids)} attackers ({args.attack.get('kind')})" if args.attacker_ids
                   else "")
    if args.holdout_ids:
        attack_note += f", {len(args.holdout_ids)} holdouts"
    transport = "plaintext" if args.tls_dir is None else "mutual TLS"
    print(f"fedguard: server {launch.address} ({transport}), {args.clients} clients ({mode}, "
          f"{args.torch_threads} torch thread{'s' if args.torch_threads > 1 else ''} each){attack_note}, "
          f"{args.rounds or num_rounds} rounds, logs in {run_dir}/", flush=True)
    outcome = watch(launch, run_dir, tls_dir=args.tls_dir, interrupts=interrupts, num_rounds=num_rounds)
    rc = outcome.server_rc
    if outcome.how in ("stopped", "stopped-unsaved", "killed"):
        for f in launch.logs:
            f.close()
        done = outcome.history[-1].round if outcome.history else 0
        how = ("stopped gracefully: the server saved the federation" if outcome.how == "stopped"
               else "killed every process" if outcome.how == "killed"
               else "stopped: the server did not finish saving in time and was killed (the federation resumes "
                    "from its last completed round)")
        print(f"launch: {how} after round {done}; wall {time.monotonic() - t0:.1f} s. Resume with:\n"
              f"  {resume_command(run_dir)}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if rc != 0 and not outcome.failed:  # the server's own error, before waiting for anything else
        detail = last_error(run_dir / "server.log")
        print(f"launch: the server exited with status {rc}" + (":\n  " + detail.replace("\n", "\n  ") if detail
                                                                else f" (see {run_dir / 'server.log'})"),
              file=sys.stderr, flush=True)
    codes = finish(launch, timeout=30.0 if outcome.how == "finished" else 2.0, interrupts=interrupts)
    bad = [i for i, c in enumerate(codes) if c != 0]
    vanished = sum(vanished_count(log) for log in launch.client_logs)
    lost = f", {vanished} clients vanished on purpose (simulated dropout/availability)" if vanished else ""
    model = run_dir / "final_model.fgt"
    where = f"; final model {model}" if rc == 0 and model.exists() else ""
    print(f"server exit {rc}; client hosts ok {len(codes) - len(bad)}/{len(codes)}{lost}; "
          f"wall {time.monotonic() - t0:.1f} s{where}", flush=True)
    if rc == 0 and outcome.history and _ended_by_dp_budget(run_dir / "server.log"):
        last = outcome.history[-1]
        print(f"launch: the privacy budget is spent: epsilon {last.dp_epsilon:.4g} (delta {last.dp_delta:g}) after "
              f"round {last.round} exceeds dp.max_epsilon, so the federation ended there (docs/privacy.md)",
              flush=True)
    if outcome.failed:
        print(f"launch: the federation was stopped because a client failed; fix the cause, then resume with:\n"
              f"  {resume_command(run_dir)}", file=sys.stderr, flush=True)
        return rc if rc not in (None, 0, 4) else 1
    if rc != 0:
        return rc if rc is not None else 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
