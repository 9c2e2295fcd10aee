"""``fedguard-launch`` (``python -m fedlaunch``): resolve the arguments, check everything, start the federation,
follow it and say how it ended (the usage text is :data:`fedlaunch.options.DESCRIPTION`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from fedcore import plugins
from fedcore.config import ConfigError, toml_literal
from fedcore.cores import cpu_cores, threads_per_process
from fedcore.plugins import one_of
from fedlaunch.credentials import make_tls_dir
from fedlaunch.follow import watch
from fedlaunch.hosts import run_worker
from fedlaunch.logs import ended_by_dp_budget, last_error, vanished_count
from fedlaunch.options import (
    LAUNCH_FILE,
    build_parser,
    given_options,
    local_data_options,
    resume_arguments,
    save_arguments,
    split_experiment,
)
from fedlaunch.plan import (
    attack_table,
    attacker_indices,
    client_id,
    configures_min_available,
    holdout_indices,
    preflight,
    simulation_plan,
)
from fedlaunch.supervise import Interrupts, finish, start

EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped (or killed) by Ctrl-C or SIGTERM; resumable


def layout_note(threads: int, processes: int, ray: bool = False) -> str:
    """The start line's note when the launcher chose the torch threads per client process itself: local training's
    float sums depend on the intra-op thread count, so another layout (``--procs``, ``--virtual``, another machine's
    core count) gives a model that differs in its last bits; pinning ``--torch-threads`` makes the layouts agree
    (docs/reliability.md, "Reproducibility guarantee")."""
    plural = "es" if processes > 1 else ""
    source = "--ray-cpus" if ray else f"{cpu_cores()} cores // {processes} client process{plural}"
    return (f"note: {threads} torch thread{'s' if threads > 1 else ''} per client process ({source}); the model's "
            f"last bits depend on it: pin --torch-threads {threads} to get the same model with another --procs or "
            "--virtual layout")


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
        # The harness crafts what the attackers would: the same attack table, on the server.
        args.server_set = [*args.server_set, "simulation_harness.full_knowledge_adversary=true",
                           *(f"simulation_harness.attack.{k}={toml_literal(v)}" for k, v in attack.items())]
    if args.attackers and attack.get("kind", "none") == "none":
        kinds = tuple(kind for kind in plugins.names("ATTACKS") if kind != "none")
        raise ConfigError("--attackers", f"needs an attack kind: --attack {one_of(kinds)} (or [launch.attack] kind)")
    if args.min_available is None and not configures_min_available(args):
        args.min_available = args.clients
    try:
        args.simulation = simulation_plan(args)
    except ValueError as e:
        raise ConfigError("simulation", str(e)) from None
    args.attacker_ids = attacker_indices(args.clients, args.attackers, args.seed or 0)
    args.holdout_ids = holdout_indices(args.clients, args.holdouts, args.seed or 0, args.attacker_ids)
    args.data_options = local_data_options(args.server_part, args.server_set)
    args.layout_note = ""
    if args.torch_threads is None or args.torch_threads == 0:
        processes = (math.ceil(args.clients / math.ceil(args.clients / max(args.procs, 1))) if args.virtual or args.ray
                     else args.clients)
        args.torch_threads = (max(1, int(args.ray_cpus)) if args.ray
                              else threads_per_process(processes) if args.procs >= 1 else 1)
        args.layout_note = layout_note(args.torch_threads, processes, bool(args.ray))
    config = preflight(args)  # everything, in-process, before a single process starts
    if args.ray:
        try:
            from fedlaunch.ray_hosts import connect, missing_resources, node_address
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
    if args.layout_note:
        print(args.layout_note, flush=True)
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
    if rc == 0 and outcome.history and ended_by_dp_budget(run_dir / "server.log"):
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
