"""The federation a launch runs, decided before anything starts: client ids, the seeded attackers, holdouts and
device simulation, the attack table, the ``fedserver`` command line, and the in-process check of the whole
configuration (:func:`preflight`)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from fedcore.config import ClientConfig, ConfigError, from_dict, parse_override
from fedlaunch.credentials import server_tls_flags


def client_id(index: int) -> str:
    return f"client-{index:05d}"


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


def configures_min_available(args: argparse.Namespace) -> bool:
    """Whether the experiment file or a --server-set override sets rounds.min_available itself."""
    if any(item.replace(" ", "").startswith("rounds.min_available=") for item in args.server_set):
        return True
    rounds = (args.server_part or {}).get("rounds", {})
    return isinstance(rounds, dict) and "min_available" in rounds


def attack_table(base: dict[str, Any], attack_set: list[str], kind: str | None,
                 knowledge: str | None) -> dict[str, Any]:
    """The attackers' attack table: the experiment file's ``[launch.attack]``, then each ``--attack-set KEY=VALUE``
    (a TOML value; a bare word is a string), then ``--attack`` and ``--knowledge``. ValueError names the item."""
    attack = dict(base)
    for item in attack_set:
        try:
            keys, value = parse_override(item)
        except ConfigError as e:
            raise ValueError(f"--attack-set: expected KEY=VALUE, got {item!r}") from e
        if len(keys) == 2 and keys[0] == "options":  # the kind's options table: options.KEY=VALUE
            table = attack.get("options")
            attack["options"] = {**(table if isinstance(table, dict) else {}), keys[1]: value}
            continue
        if len(keys) != 1:
            raise ValueError(f"--attack-set: expected an attack option KEY=VALUE (or options.KEY=VALUE), got {item!r}")
        attack[keys[0]] = value  # a flat key of the kind's options is read into attack.options
    if kind:
        attack["kind"] = kind
    if knowledge:
        attack["knowledge"] = knowledge
    attack = _kind_options(attack)
    if attack:  # refused here, naming the field, before a server or client starts
        from fedcore.attacks.config import AttackConfig, check_model_attack

        try:
            check_model_attack(from_dict(AttackConfig, attack, "attack"))
        except (ConfigError, ValueError) as e:
            raise ValueError(f"attack options: {e}") from e
    return attack


def _kind_options(attack: dict[str, Any]) -> dict[str, Any]:
    """The attack table with the options of its kind in ``options``: the old flat keys (``--attack-set boost=5``)
    are moved there (a flat key given later wins over the file's ``options``), and the options of other kinds are
    left out -- an experiment's ``[launch.attack]`` is shared by its arms (``--attack`` picks each arm's kind), as
    it was when every kind's options sat in one flat table. A key no kind declares stays, to be refused by name."""
    from fedcore.attacks.config import ATTACKS
    from fedcore.migrate import LEGACY_ATTACK_OPTIONS
    from fedcore.registry import option_names

    table = dict(attack)
    raw = table.pop("options", None)
    options = dict(raw) if isinstance(raw, dict) else {}
    if raw is not None and not isinstance(raw, dict):
        return attack  # refused by the attack section, naming attack.options
    for key in [k for k in table if k in LEGACY_ATTACK_OPTIONS]:
        options[key] = table.pop(key)
    kind = table.get("kind", "none")
    declared = option_names(ATTACKS, kind) if isinstance(kind, str) and kind in ATTACKS else list(options)
    kept = {k: v for k, v in options.items() if k in declared or k not in LEGACY_ATTACK_OPTIONS}
    if kept:
        table["options"] = kept
    return table


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
    from fedcore.preflight import check_fleet, check_server_config

    if args.procs is not None and args.procs < 1:
        raise ConfigError("--procs", f"must be >= 1, got {args.procs}")
    if args.torch_threads is not None and args.torch_threads < 0:
        raise ConfigError("--torch-threads", f"must be >= 0, got {args.torch_threads}")
    if args.k is not None and not 1 <= args.k <= args.clients:
        raise ConfigError("rounds.clients_per_round", f"-k {args.k} must be in [1, --clients {args.clients}] (K "
                                                      f"updates per round out of {args.clients} clients)")
    if args.min_available is not None and not configures_min_available(args):
        # K from the experiment file against the fleet first: the launcher's min_available = N would hide it
        check_fleet(resolve_server_config(argparse.Namespace(**{**vars(args), "min_available": None})),
                    args.clients)
    config = resolve_server_config(args)
    check_server_config(config, num_clients=args.clients)
    ClientConfig(trainer=args.trainer or "", private_epochs=args.private_epochs, device=args.device,
                 insecure=True).validate()
    return config
