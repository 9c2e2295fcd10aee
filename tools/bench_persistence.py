"""Cost of the coordinator's durability (fedserver.store), one mode per subcommand.

  snapshot  StateStore.save of one completed round: every model (fedcore.serialization format, sha256 while
            writing) + one SQLite WAL commit of the coordinator's JSON state (round machine with --clients
            client records, the history of every round so far) + pruning beyond --keep. Timed over --rounds
            saves in a temp dir, with fsync off (survives kill -9) and on (survives a power cut); then the
            time of one StateStore.load (verifies sizes, sha256 and parses every model of the newest snapshot).

    python tools/bench_persistence.py snapshot
    python tools/bench_persistence.py snapshot --models mlp --rounds 50 --clients 1000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fedcore import rounds as rm
from fedcore.models import build_model
from fedcore.report import RoundReport
from fedserver.store import Snapshot, StateStore

MODELS = ("mlp", "cifar_cnn", "resnet18_cifar")


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
    return {"round_state": state.to_dict(), "history": [h.to_dict() for h in history], "slots": {}}


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
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    args.func(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
