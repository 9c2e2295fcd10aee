"""``fedclient``: take part in a federation from this device.

By default the client builds the model the server announces and derives its data shard from the
server's dataset (simulation); ``--data-index`` picks the shard. TLS by default (``--ca-cert``; mutual TLS with
``--cert``/``--key``; ``--signing-key`` signs every request); plaintext only with ``--insecure``. A server can
name only built-in models, registered datasets and trainers and non-path data options: anything else it
announces is refused (exit 2). Exit status: 0 when the federation
finished, 2 for a bad configuration or a refused join (e.g. a model mismatch), 4 when the server refuses this client
(a TLS handshake or authentication check failed: one line names it, within seconds), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from types import FrameType

from fedcore.about import VersionAction

# Only what the parser needs is imported here: ``fedclient --help`` answers without importing torch.
from fedcore.config import TOKEN_ENV, ClientConfig, ConfigError, build_config, parse_override
from fedcore.plugins import described, names, one_of

# The attack registry's names (fedcore.attacks.config.ATTACKS; no torch for --help).
ATTACK_KINDS = names("ATTACKS")

_FLAGS = {
    "server": (str, "server address host:port"),
    "client_id": (str, "stable client identity (default: from --state-dir, else random)"),
    "token": (str, "join secret (visible in ps: prefer --token-file or FEDGUARD_TOKEN)"),
    "token_file": (str, "file holding the join secret"),
    "ca_cert": (str, "PEM CA that signed the server's certificate (default: the system's trusted roots)"),
    "cert": (str, "PEM client certificate, for a server that requires mutual TLS"),
    "key": (str, "PEM key of the client certificate"),
    "server_name": (str, "name to check the server certificate against (default: the host in --server)"),
    "signing_key": (str, "Ed25519 key that signs every request (fedguard-certs keygen)"),
    "dataset": (str, f"this client's own dataset: {one_of(names('DATASETS'))} (default: the server's, with its "
                     "partition options only)"),
    "state_dir": (str, "directory that keeps the client's identity across restarts"),
    "data_index": (int, "shard index of the server's dataset (simulation)"),
    "trainer": (str, "this client's own trainer (default: the method the server announces, [recovery] method): "
                     f"{described('TRAINERS')}"),
    "straggler": (str, "simulation: straggler delay 'fixed' (default) or 'lognormal'"),
    "straggler_delay": (float, "simulation: extra seconds before each upload (lognormal: the median)"),
    "straggler_sigma": (float, "simulation: log-space standard deviation of a lognormal straggler delay"),
    "dropout": (float, "simulation: per-round probability of taking the task and never answering"),
    "dropout_return": (float, "simulation: seconds of silence after a dropout before coming back (< 0: never)"),
    "crash": (float, "simulation: per-round probability of crashing after training (update and session lost)"),
    "crash_rejoin": (float, "simulation: seconds after a crash before re-joining"),
    "sim_seed": (int, "simulation: seed mixed into every draw"),
    "long_poll": (float, "longest server-side wait of one poll, seconds"),
    "give_up_after": (float, "stop after this many seconds without the server (0 = never)"),
    "torch_threads": (int, "torch intra-op threads (default: max(1, cores // client processes on this machine), "
                           "counted at start)"),
    "private_epochs": (int, "train a private model this many epochs first and report its accuracy P_i"),
    "device": (str, "where to train: cpu (default), cuda, cuda:N, or auto (a GPU when torch sees one)"),
}
_PATHS = {"straggler": "simulation.straggler", "straggler_delay": "simulation.straggler_delay_s",
          "straggler_sigma": "simulation.straggler_sigma", "dropout": "simulation.dropout",
          "dropout_return": "simulation.dropout_return_s", "crash": "simulation.crash",
          "crash_rejoin": "simulation.crash_rejoin_s", "sim_seed": "simulation.seed", "long_poll": "long_poll_s",
          "give_up_after": "give_up_after_s"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedclient", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=VersionAction)
    ap.add_argument("--config", help="TOML file with ClientConfig fields")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    for flag, (tp, help_) in _FLAGS.items():
        ap.add_argument("--" + flag.replace("_", "-"), dest=flag, type=tp, help=help_)
    ap.add_argument("--model", help="model name or pkg.mod:factory (default: what the server announces)")
    ap.add_argument("--attack", choices=list(ATTACK_KINDS),
                    help="simulation only: play an attacker (options: --set attack.KEY=VALUE): "
                         f"{described('ATTACKS')}")
    ap.add_argument("--opt-out", action="store_true", default=None,
                    help="a vanilla holdout: never adapt, infer with the received model, still report beta_hat_i")
    ap.add_argument("--availability", metavar="JSON",
                    help="simulation: online windows [[start_s, end_s], ...] in seconds since the client started")
    ap.add_argument("--data-options", help="JSON object: this client's own dataset options (data_dir, path, source, "
                                            "cache_dir, download), which a server can never set")
    ap.add_argument("--insecure", action="store_true", default=None,
                    help="plaintext gRPC (no TLS): only on a network you trust")
    ap.add_argument("--log-json", action="store_true", default=None)
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fedcore.log import configure_logging

    overrides = [parse_override(s) for s in args.set]
    for flag in _FLAGS:
        value = getattr(args, flag)
        if value is not None:
            overrides.append((_PATHS.get(flag, flag).split("."), value))
    if args.attack is not None:
        overrides.append((["attack", "kind"], args.attack))
    if args.opt_out is not None:
        overrides.append((["opt_out"], True))
    if args.insecure is not None:
        overrides.append((["insecure"], True))
    token = os.environ.get(TOKEN_ENV)
    if token and args.token is None and args.token_file is None:
        overrides.append((["token"], token))
    if args.data_options is not None:
        try:
            overrides.append((["data_options"], json.loads(args.data_options)))
        except json.JSONDecodeError as e:
            print(f"fedclient: configuration error: data_options: --data-options is not valid JSON: {e}",
                  file=sys.stderr)
            return 2
    if args.availability is not None:
        try:
            overrides.append((["simulation", "availability"], json.loads(args.availability)))
        except json.JSONDecodeError as e:
            print(f"fedclient: configuration error: simulation.availability: --availability is not valid JSON: {e}",
                  file=sys.stderr)
            return 2
    if args.log_json is not None:
        overrides.append((["log_json"], True))
    if args.log_level is not None:
        overrides.append((["log_level"], args.log_level))
    try:
        config = build_config(ClientConfig, args.config, overrides)
        from fedcore.preflight import check_data_dir

        check_data_dir(config.data_options, "data_options")  # an explicit data_dir that is not there: now
    except ConfigError as e:
        print(f"fedclient: configuration error: {e}", file=sys.stderr)
        return 2
    if not config.torch_threads:  # co-hosted client processes share the cores (fedcore.cores)
        from fedcore.cores import client_processes, threads_per_process

        config.torch_threads = threads_per_process(client_processes())
    configure_logging(json=config.log_json, level=config.log_level)
    from fedclient.client import FedClient, FedClientError, FedClientRefused
    from fedcore.startup_gc import freeze_startup_objects

    try:
        client = FedClient(config, model=args.model)
    except FedClientError as e:  # e.g. an unreadable --token-file
        print(f"fedclient: {e}", file=sys.stderr)
        return 2

    def on_signal(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=client.stop, daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    freeze_startup_objects()  # the imports, the model and the data live as long as the process
    try:
        summary = client.run()
    except FedClientRefused as e:  # a TLS handshake or authentication check failed: retrying cannot help
        print(f"fedclient: {e}", file=sys.stderr)
        return 4
    except FedClientError as e:
        print(f"fedclient: {e}", file=sys.stderr)
        return 2
    if summary.vanished:  # simulated dropout or availability: gone on purpose, not a failure
        print(f"fedclient: {summary.client_id} vanished (simulated device)", file=sys.stderr)
    return 0 if summary.finished or summary.vanished else 1


if __name__ == "__main__":
    sys.exit(main())
