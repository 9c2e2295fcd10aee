"""``fedserver``: run a federation coordinator.

Configuration: defaults <- ``--config FILE.toml`` <- ``--set section.key=value`` <- the named flags below.
The run directory (``--run-dir``) holds the federation's state: started again with the same command line, the
server resumes an unfinished federation from its last completed round (a round in flight is re-run), and
does nothing for a finished one; ``--fresh`` moves the old state aside into ``RUN_DIR/previous/`` and starts
over. A configuration that would change the stored federation (model, data, training, aggregation, seed, K)
is refused, naming the field.

Transport: TLS with --tls-cert/--tls-key (fedguard-certs makes them), mutual TLS with --client-ca (the client
id is the certificate's), signed requests with --client-keys; plaintext only with an explicit --insecure.

SIGTERM or SIGINT stops gracefully: no more updates are taken, the state is saved, polling clients are told
to come back, and the exit status is 4; the next start resumes.

Exit status: 0 when the federation completed its rounds (or had already completed them), 2 for a bad
configuration, 3 when it stalled (too few clients within ``rounds.sampling_timeout_s``), 4 when stopped by
a signal before it finished (resumable), 1 for an unexpected error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from fedcore.about import VersionAction
from fedcore.config import TOKEN_ENV, ConfigError, ServerConfig, build_config, load_toml, parse_override, redacted
from fedcore.plugins import described, names, one_of
from fedserver.errors import EXIT_CONFIG, EXIT_STALLED, EXIT_STOPPED

# Only what the parser needs is imported here: ``fedserver --help`` answers without importing torch.
if TYPE_CHECKING:
    from fedcore.report import FederationStatus

# flag -> (config path, type)
_FLAGS: dict[str, tuple[str, Any, str]] = {
    "address": ("server.address", str, "host:port to listen on (port 0 picks a free one)"),
    "framed_address": ("server.framed_address", str, "host:port of the framed Session transport beside gRPC, "
                                                     "announced to the clients at join (default auto: --address's "
                                                     "port + 1; port 0 picks a free one; \"\" turns it off)"),
    "run_dir": ("server.run_dir", str, "directory for the final model, rounds.jsonl and config.json"),
    "token": ("server.token", str, "shared join secret clients must present (visible in ps: prefer --token-file "
                                   "or FEDGUARD_TOKEN)"),
    "token_file": ("server.token_file", str, "file holding the join secret"),
    "tls_cert": ("security.tls_cert", str, "PEM server certificate (fedguard-certs server)"),
    "tls_key": ("security.tls_key", str, "PEM key of the server certificate"),
    "client_ca": ("security.client_ca", str, "mutual TLS: PEM CA that signed the client certificates; the client "
                                            "id is the certificate's"),
    "client_keys": ("security.client_keys", str, "enrollment file of client Ed25519 keys (fedguard-certs keygen "
                                                "--enroll): every request must be signed"),
    "crl": ("security.crl", str, "mutual TLS: certificate revocation list (fedguard-certs revoke), re-read when it "
                                 "changes; a revoked client is refused at its next call"),
    "event_loop": ("server.event_loop", str, "asyncio event loop: auto (uvloop where installed), uvloop or asyncio"),
    "operator_token_file": ("security.operator_token_file", str, "file holding the operator token that GetStatus "
                                                                "requires (or FEDGUARD_OPERATOR_TOKEN)"),
    "rounds": ("rounds.num_rounds", int, "number of rounds R"),
    "clients_per_round": ("rounds.clients_per_round", int, "K: updates that close a round"),
    "min_updates": ("rounds.min_updates", int, "updates that suffice when a round closes early or at its deadline "
                                               "(0 = half of K rounded up, raised to what the aggregation rule "
                                               "needs)"),
    "min_available": ("rounds.min_available", int, "clients needed before a round starts (0 = K)"),
    "over_select": ("rounds.over_select", float, "select ceil(K * over_select) clients"),
    "round_timeout": ("rounds.round_timeout_s", float, "round deadline in seconds"),
    "seed": ("rounds.seed", int, "seed of selection and model initialisation"),
    "model": ("model.name", str, f"model: {one_of(names('MODELS'))}, or an import path pkg.mod:factory"),
    "dataset": ("data.dataset", str, f"dataset clients derive their shards from: {one_of(names('DATASETS'))}"),
    "epochs": ("training.local_epochs", int, "local epochs E"),
    "batch_size": ("training.batch_size", int, "local batch size B"),
    "lr": ("training.learning_rate", float, "client learning rate"),
    "rule": ("aggregation.rule", str, f"aggregation rule: {one_of(names('RULES'))} (default fedavg)"),
    "nfl_mode": ("nfl.mode", str, f"{one_of(names('NFL_MODES'))} (default {names('NFL_MODES')[0]})"),
    "detector": ("nfl.detector", str, f"NFL detector: {described('DETECTORS')}"),
    "nr": ("nfl.nr", int, "beta_hat: report NFL after more than NR negative rounds"),
    "c": ("nfl.c", int, "beta_hat: average the last c round medians; cancel after c non-negative rounds"),
    "epsilon": ("nfl.epsilon", float, "delta: the threshold epsilon on delta"),
    "r_prime": ("nfl.r_prime", int, "delta: report NFL after more than r' rounds with delta > epsilon"),
    "recovery": ("nfl.recovery", str, "long-term (never stops) or short-term (stops at the cancel)"),
    "recovery_method": ("recovery.method", str, f"the clients' recovery method, a trainer (default flguard): "
                                               f"{described('TRAINERS')}"),
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedserver", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=VersionAction)
    ap.add_argument("--config", help="TOML configuration file")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override any configuration field (value is a TOML literal); repeatable")
    for flag, (path, tp, help_) in _FLAGS.items():
        ap.add_argument("--" + flag.replace("_", "-"), dest=flag, type=tp, help=f"{help_} [{path}]")
    ap.add_argument("-k", dest="clients_per_round", type=int, help="same as --clients-per-round")
    ap.add_argument("--model-kwargs", help="JSON object of model factory arguments [model.kwargs]")
    ap.add_argument("--data-options", help="JSON object of dataset options [data.options]")
    ap.add_argument("--recovery-options", help="JSON object of the recovery method's options [recovery.options]")
    ap.add_argument("--log-json", action="store_true", default=None, help="JSON log lines [server.log_json]")
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="[server.log_level]")
    ap.add_argument("--linger", type=float, default=10.0,
                    help="after the last round, keep answering until every live client was told it finished "
                         "and has left, or until none has left for this many seconds")
    ap.add_argument("--fresh", action="store_true",
                    help="start a new federation even if RUN_DIR holds one; the old state is moved to "
                         "RUN_DIR/previous/<time>/, never deleted")
    ap.add_argument("--fall-back", action="store_true", default=None,
                    help="when the newest snapshots in RUN_DIR/state fail verification, resume from the newest one "
                         "that verifies; the others move to RUN_DIR/state/quarantine/<time>/, kept "
                         "[persistence.fall_back]")
    ap.add_argument("--insecure", action="store_true", default=None,
                    help="serve plaintext gRPC (no TLS): only on a network you trust [security.insecure]")
    ap.add_argument("--print-config", action="store_true",
                    help="print the effective configuration (secrets redacted) and exit")
    return ap


def config_from_args(args: argparse.Namespace, transport_optional: bool = False) -> ServerConfig:
    """The configuration: defaults <- ``--config`` (its ``[launch]`` table, the launcher's, is left out with a
    note) <- ``--set`` <- the named flags. ``transport_optional`` (``--print-config``): no TLS files and no
    ``--insecure`` is not an error (a note says the server needs one of them to start)."""
    overrides: list[tuple[list[str], Any]] = []
    if args.config:
        data = load_toml(args.config)
        if data.pop("launch", None) is not None:
            print(f"fedserver: note: {args.config}: the [launch] table holds fedguard-launch's options (clients, "
                  "attackers, ...); the server ignores it", file=sys.stderr)
        overrides += [([section], value) for section, value in data.items()]
    overrides += [parse_override(s) for s in args.set]
    for flag, (path, _, _) in _FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append((path.split("."), value))
    for flag, path in (("model_kwargs", "model.kwargs"), ("data_options", "data.options"),
                       ("recovery_options", "recovery.options")):
        raw = getattr(args, flag)
        if raw is not None:
            try:
                overrides.append((path.split("."), json.loads(raw)))
            except json.JSONDecodeError as e:
                raise ConfigError(path, f"--{flag.replace('_', '-')} is not valid JSON: {e}") from None
    if args.insecure is not None:
        overrides.append((["security", "insecure"], True))
    if args.fall_back is not None:
        overrides.append((["persistence", "fall_back"], True))
    token = os.environ.get(TOKEN_ENV)
    if token and args.token is None and args.token_file is None:
        overrides.append((["server", "token"], token))
    if args.log_json is not None:
        overrides.append((["server", "log_json"], True))
    if args.log_level is not None:
        overrides.append((["server", "log_level"], args.log_level))
    try:
        return build_config(ServerConfig, None, overrides)
    except ConfigError as e:
        if not (transport_optional and e.field == "security.tls_cert"):
            raise
    config = build_config(ServerConfig, None, [*overrides, (["security", "insecure"], True)])
    config.security.insecure = False
    print("fedserver: note: no transport given: to start, the server needs --tls-cert/--tls-key (TLS) or "
          "--insecure", file=sys.stderr)
    return config


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.run_dir and not args.print_config:
        from fedserver.rundir import RunDirLock, RunDirLocked
        from fedserver.store import StoreError, check_state

        # Before torch is imported (seconds): a run dir in use or a damaged state is refused at once.
        try:
            RunDirLock.probe(args.run_dir)
            if not args.fresh:
                check_state(os.path.join(args.run_dir, "state"), fall_back=bool(args.fall_back))
        except RunDirLocked as e:
            print(f"fedserver: run directory: {e}", file=sys.stderr)
            return EXIT_CONFIG
        except StoreError as e:
            print(f"fedserver: state store: {e}", file=sys.stderr)
            return EXIT_CONFIG
    from fedcore.log import configure_logging
    from fedserver.rundir import RunDirLocked
    from fedserver.store import StoreError

    try:
        config = config_from_args(args, transport_optional=args.print_config)
        if not args.print_config:
            # the data present, the model on one of its samples, the aggregation's memory: before listening
            from fedcore.preflight import check_server_config

            check_server_config(config)
        if config.evaluation.central:
            from fedserver.coordinator import evaluation_device

            evaluation_device(config)
    except (ConfigError, ValueError) as e:
        print(f"fedserver: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(json.dumps(redacted(config), indent=2))
        return 0
    configure_logging(json=config.server.log_json, level=config.server.log_level)
    if not config.security.insecure:  # refused TLS handshakes become tls.handshake_refused events
        from fedcore.log import get_logger
        from fedserver.corelog import capture_handshake_failures

        capture_handshake_failures(get_logger("fedserver"))
    from fedcore.startup_gc import freeze_startup_objects
    from fedserver import event_loop
    from fedserver.app import serve

    def serving(*_: object) -> None:
        freeze_startup_objects()  # the imports, the model and the restored state live as long as the process

    async def go() -> FederationStatus | Exception:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            return await serve(config, stop=stop, linger_s=args.linger, fresh=args.fresh, ready=serving)
        except (ConfigError, StoreError, RunDirLocked, OSError) as e:
            # Returned, not raised: the event loop then winds down gRPC's own tasks as after a normal stop
            # (an exception escaping asyncio.run leaves them to print CancelledError tracebacks).
            return e

    try:
        result = event_loop.run(go, config.server.event_loop)
        if isinstance(result, Exception):
            raise result
        status = result
    except ConfigError as e:
        print(f"fedserver: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except StoreError as e:
        print(f"fedserver: state store: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except RunDirLocked as e:
        print(f"fedserver: run directory: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as e:
        print(f"fedserver: {e}", file=sys.stderr)
        return 1
    return exit_code(status)


def exit_code(status: FederationStatus) -> int:
    if status.finished and status.outcome == "stalled":
        return EXIT_STALLED
    if not status.finished:
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
