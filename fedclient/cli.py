"""``fedclient``: take part in a federation from this device.

By default the client builds the model the server announces and derives its data shard from the
server's dataset (simulation); ``--data-index`` picks the shard. Exit status: 0 when the federation
finished, 2 for a bad configuration or a refused join (e.g. a model mismatch), 1 otherwise.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from types import FrameType

from fedcore.config import ClientConfig, ConfigError, build_config, parse_override
from fedcore.log import configure_logging

_FLAGS = {
    "server": (str, "server address host:port"),
    "client_id": (str, "stable client identity (default: from --state-dir, else random)"),
    "token": (str, "join secret"),
    "state_dir": (str, "directory that keeps the client's identity across restarts"),
    "data_index": (int, "shard index of the server's dataset (simulation)"),
    "trainer": (str, "flguard (default: local SGD, FL-GUARD adaptation while recovering), vanilla, or noop "
                     "(return the model at once; benchmarks)"),
    "straggler_delay": (float, "simulated extra seconds before each upload"),
    "long_poll": (float, "longest server-side wait of one poll, seconds"),
    "give_up_after": (float, "stop after this many seconds without the server (0 = never)"),
    "torch_threads": (int, "torch intra-op threads (0 = torch default)"),
    "private_epochs": (int, "train a private model this many epochs first and report its accuracy P_i"),
    "device": (str, "where to train: cpu (default), cuda, cuda:N, or auto (a GPU when torch sees one)"),
}
_PATHS = {"straggler_delay": "straggler_delay_s", "long_poll": "long_poll_s", "give_up_after": "give_up_after_s"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="fedclient", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML file with ClientConfig fields")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    for flag, (tp, help_) in _FLAGS.items():
        ap.add_argument("--" + flag.replace("_", "-"), dest=flag, type=tp, help=help_)
    ap.add_argument("--model", help="model name or pkg.mod:factory (default: what the server announces)")
    ap.add_argument("--attack", choices=["none", "label_flip", "backdoor"],
                    help="simulation only: play a data-poisoning attacker (options: --set attack.KEY=VALUE)")
    ap.add_argument("--opt-out", action="store_true", default=None,
                    help="a vanilla holdout: never adapt, infer with the received model, still report beta_hat_i")
    ap.add_argument("--log-json", action="store_true", default=None)
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = [parse_override(s) for s in args.set]
    for flag in _FLAGS:
        value = getattr(args, flag)
        if value is not None:
            overrides.append(([_PATHS.get(flag, flag)], value))
    if args.attack is not None:
        overrides.append((["attack", "kind"], args.attack))
    if args.opt_out is not None:
        overrides.append((["opt_out"], True))
    if args.log_json is not None:
        overrides.append((["log_json"], True))
    if args.log_level is not None:
        overrides.append((["log_level"], args.log_level))
    try:
        config = build_config(ClientConfig, args.config, overrides)
    except ConfigError as e:
        print(f"fedclient: configuration error: {e}", file=sys.stderr)
        return 2
    configure_logging(json=config.log_json, level=config.log_level)
    from fedclient.client import FedClient, FedClientError

    client = FedClient(config, model=args.model)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        threading.Thread(target=client.stop, daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        summary = client.run()
    except FedClientError as e:
        print(f"fedclient: {e}", file=sys.stderr)
        return 2
    return 0 if summary.finished else 1


if __name__ == "__main__":
    sys.exit(main())
