"""The launcher's command line: the parser, experiment files (a server TOML plus a ``[launch]`` table), and the
arguments saved in the run directory for ``--resume``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from fedcore.about import VersionAction
from fedcore.config import ConfigError, load_toml, merge_override, parse_override
from fedcore.plugins import names, one_of

DESCRIPTION = """``fedguard-launch``: one ``fedserver`` plus N clients, printing one line per round.

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


LAUNCH_KEYS = {"clients", "virtual", "procs", "attackers", "attack", "private_epochs", "rounds", "k", "trainer",
               "device", "holdouts"}


TRAINER_CHOICES = names("TRAINERS")  # the trainer registry's names (no torch for --help)


# Launcher options that define the federation: changing one on --resume is refused, naming it.
FEDERATION_OPTIONS = ("clients", "k", "seed", "config", "server_set", "attackers", "attack", "attack_set",
                      "knowledge", "holdouts", "trainer", "private_epochs", "min_updates")


LAUNCH_FILE = "launch.json"


# Dataset options that are paths or local choices: a server never announces them, so the launcher hands them
# to its clients itself (the clients then read the data the configuration names, never another copy).
LOCAL_DATA_OPTIONS = ("data_dir", "path", "source", "cache_dir", "download")


def split_experiment(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read an experiment file: its ``[launch]`` table and the server part. :class:`ConfigError` names an unknown
    ``[launch]`` key and the known ones."""
    data = load_toml(path)
    launch = data.pop("launch", {})
    if not isinstance(launch, dict):
        raise ConfigError("launch", f"expected a table, got {launch!r}")
    for key in sorted(set(launch) - LAUNCH_KEYS):
        raise ConfigError(f"launch.{key}", f"unknown field; known: {', '.join(sorted(LAUNCH_KEYS))}")
    return dict(launch), data


def local_data_options(server_part: dict[str, Any], server_set: list[str]) -> dict[str, Any]:
    """The local dataset options (``data_dir``, ...) of the server configuration, which clients get from the
    launcher (a server never announces paths)."""
    data: dict[str, Any] = json.loads(json.dumps(server_part))
    for item in server_set:
        keys, value = parse_override(item)
        merge_override(data, keys, value)
    options = data.get("data", {}).get("options", {})
    return {k: options[k] for k in LOCAL_DATA_OPTIONS if isinstance(options, dict) and k in options}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedguard-launch", description=DESCRIPTION,
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
                    help="any server configuration field (a TOML value), e.g. model.name (" + one_of(names("MODELS"))
                         + "), data.dataset (" + one_of(names("DATASETS")) + "), aggregation.rule ("
                         + one_of(names("RULES")) + "), nfl.detector (" + one_of(names("DETECTORS")) + "); repeatable")
    ap.add_argument("--virtual", action="store_true", default=None, help="host many clients per process (threads)")
    ap.add_argument("--procs", type=int, help="client processes in --virtual mode (default 2)")
    ap.add_argument("--trainer", choices=TRAINER_CHOICES,
                    help="the clients' own trainer (default: the server's [recovery] method, flguard unless "
                         "configured; e.g. --server-set recovery.method='ditto')")
    ap.add_argument("--holdouts", type=float,
                    help="fraction of the benign clients that opt out of recovery (vanilla holdouts; default 0)")
    ap.add_argument("--nfl-mode", choices=names("NFL_MODES"),
                    help="the server's [nfl] mode (default: the config's, else detect-and-recover)")
    ap.add_argument("--attackers", type=float, help="fraction of clients that attack (default 0)")
    ap.add_argument("--attack", choices=names("ATTACKS"),
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
