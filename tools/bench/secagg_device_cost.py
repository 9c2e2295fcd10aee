"""Where a device's CPU goes in a secure round: one process, a ServerThread and K FedClient threads on loopback,
the same CIFAR-10 federation (the CNN, one local epoch, batch 10) plain and then with ``aggregation.secure =
"secagg+"``, each step of the device's round timed with its thread's CPU clock (``time.thread_time``).

    FEDGUARD_DATA_DIR=../shared/data python tools/bench/secagg_device_cost.py -k 100 --rounds 2

Prints, per device-round: training (``RoundRunner._train``), the upload (``_push``), the secure phases
(``SecureClient.prepare``: keys and shares; ``masked_input``: u_i, encoding and masks; ``unmask``) and the whole task
(``_work``), and the process's CPU and each round's seconds. Everything shares the machine's cores, as the virtual
clients of ``tools/bench/bench_secagg.py --federation`` do; gRPC's own threads are not in the per-step figures.
"""

from __future__ import annotations

import argparse
import collections
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STEPS = (("work", "RoundRunner", "_work"), ("train", "RoundRunner", "_train"), ("push", "RoundRunner", "_push"),
         ("prepare", "SecureClient", "prepare"), ("masked_input", "SecureClient", "masked_input"),
         ("unmask", "SecureClient", "unmask"))
# The parts of masked_input: the device's plain input, then the protocol's masking (and, inside it, the masks).
PARTS = (("prepare_input", "secure", "prepare_input"), ("client_mask", "protocol", "client_mask"),
         ("apply_masks", "prg", "apply_masks"))


def run(secure: bool, k: int, rounds: int, cache: str) -> dict[str, Any]:
    from fedclient import ClientConfig, FedClient, runner
    from fedclient import secure as client_secure
    from fedcore.config import ServerConfig, build_config
    from fedserver import ServerThread

    spent: dict[str, float] = collections.defaultdict(float)
    lock = threading.Lock()
    saved = []

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = resource.getrusage(resource.RUSAGE_THREAD)
            try:
                return fn(*args, **kwargs)
            finally:
                after = resource.getrusage(resource.RUSAGE_THREAD)
                with lock:
                    spent[name] += (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                    spent[name + ".sys"] += after.ru_stime - before.ru_stime
                    spent[name + ".faults"] += after.ru_minflt - before.ru_minflt
        return wrapper

    from fedcore.secagg import prg, protocol
    owners: dict[str, Any] = {"RoundRunner": runner.RoundRunner, "SecureClient": client_secure.SecureClient,
                              "secure": client_secure, "protocol": protocol, "prg": prg}
    for name, owner, attr in STEPS + PARTS:
        cls = owners[owner]
        saved.append((cls, attr, getattr(cls, attr)))
        setattr(cls, attr, timed(name, getattr(cls, attr)))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sections: dict[str, dict[str, Any]] = {
                "server": {"address": "127.0.0.1:0", "run_dir": str(Path(tmp) / "run")},
                "security": {"insecure": True},
                "rounds": {"num_rounds": rounds, "clients_per_round": k, "round_timeout_s": 900.0, "min_updates": k},
                "model": {"name": "cifar_cnn"},
                "data": {"dataset": "cifar10", "options": {"num_clients": max(100, k), "partition": "iid",
                                                           "pool": "train", "cache_dir": cache}},
                "training": {"local_epochs": 1, "batch_size": 10, "learning_rate": 0.1},
                "aggregation": {"secure": "secagg+" if secure else "off"},
                "evaluation": {"central": False},
            }
            cfg = build_config(ServerConfig, None, [([sec, key], v) for sec, values in sections.items()
                                                    for key, v in values.items()])
            srv = ServerThread(cfg, linger_s=1.0).start()
            cpu, wall = time.process_time(), time.time()
            clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}",
                                              data_index=i, long_poll_s=60.0)).start() for i in range(k)]
            status = srv.wait(3600)
            for c in clients:
                c.join(60)
            cpu, wall = time.process_time() - cpu, time.time() - wall
    finally:
        for cls, attr, fn in saved:
            setattr(cls, attr, fn)
    assert status is not None and status.outcome == "completed", status
    return {"steps": {n: v / (rounds * k) for n, v in spent.items()}, "cpu": cpu, "wall": wall,
            "rounds": [h.seconds for h in status.history]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", type=int, default=100, help="devices, all selected every round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / "runs" / "cache"), help="CIFAR-10 shard cache directory")
    ap.add_argument("--only", choices=("plain", "secagg+"), help="run one of the two")
    args = ap.parse_args(argv)
    runs = ("plain", "secagg+") if args.only is None else (args.only,)
    out = {name: run(name == "secagg+", args.k, args.rounds, args.cache) for name in runs}
    names = [n for n, _, _ in STEPS + PARTS]
    print(f"K = {args.k}, {args.rounds} rounds, CIFAR-10 CNN, one local epoch; per device-round: thread CPU s "
          "(user + system), then the system part and the minor page faults")
    print("| run | " + " | ".join(names) + " | process CPU s | wall s | round s |")
    print("|---|" + "---:|" * (len(names) + 3))
    for name, r in out.items():
        cells = [(f"{r['steps'][n]:.4f} ({r['steps'][n + '.sys']:.4f} sys, {r['steps'][n + '.faults']:.0f} flt)"
                  if n in r["steps"] else "-") for n in names]
        print(f"| {name} | " + " | ".join(cells) + f" | {r['cpu']:.1f} | {r['wall']:.1f} | "
              + ", ".join(f"{s:.1f}" for s in r["rounds"]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
