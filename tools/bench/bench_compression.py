"""Compressed updates measured (issue 52 item 4; docs/results/compression.md).

    python tools/bench/bench_compression.py                  # bytes per client-round (CIFAR CNN) + server CPU, per kind
    python tools/bench/bench_compression.py --accuracy --out runs/compression_acc [--rounds 150] [--kinds none int8 ...]
    python tools/bench/bench_compression.py --summary runs/compression_acc      # the accuracy table of a campaign

Bytes: a small real federation per kind over gRPC on loopback (``cifar_cnn``, 940,362 parameters; the devices train on
a few random images of their own), the bytes per client-round read from the server's ``bytes_received`` in
``rounds.jsonl`` (the update payload the server took), against fp32 (kind none: the weights as they are).

Server CPU: the server's receive path of one client-round, in this process, kinds interleaved: the update's bytes
fed in ``chunk_bytes`` pieces to what the servicer feeds them to (the Reassembler, or the kind's streaming Decoder),
then the intake's work (u_i from the received weights for none, the finite check, the FedAvg aggregator's add);
thread CPU seconds per client-round, median of ``--reps``.

Accuracy: the MNIST NFL environment (configs/mnist_nfl.toml: 100 clients, K = 10, 30% label-flipping attackers,
server-side DP) with plain FedAvg (``--nfl-mode off``) per kind, one run at a time, each a launcher run resumed when
the same command runs again (tools/runs.py: a finished run is skipped); the table reports the central accuracy of the
final model and the mean of the last 10 rounds. ``--private-epochs`` defaults to 0: the private models only serve
beta, which the comparison does not read.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.runs import Job, RunDirError, finite_mean, read_rows, run_jobs, run_state  # noqa: E402

KINDS = ("none", "fp16", "int8", "topk")
CONFIG = "configs/mnist_nfl.toml"
LAST = 10
INT8_GOAL = 0.26  # int8 bytes <= 26% of fp32
ACCURACY_GOAL = 0.005  # fp16 and int8 within 0.5 point of none


# ---- bytes per client-round, over a real federation ----

def measure_bytes(kinds: tuple[str, ...], clients: int = 2, rounds: int = 1) -> dict[str, float]:
    """Bytes per client-round of each kind from the server's rows (cifar_cnn, ``clients`` devices)."""
    import torch

    from fedclient import ClientConfig, FedClient
    from fedcore.config import ServerConfig, build_config
    from fedcore.data.source import DataSource
    from fedserver import ServerThread

    out: dict[str, float] = {}
    for kind in kinds:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = build_config(ServerConfig, None, [
                (["server", "address"], "127.0.0.1:0"), (["server", "run_dir"], f"{tmp}/run"),
                (["security", "insecure"], True), (["model", "name"], "cifar_cnn"),
                (["rounds", "num_rounds"], rounds), (["rounds", "clients_per_round"], clients),
                (["training", "batch_size"], 8), (["compression", "kind"], kind)])
            srv = ServerThread(cfg, linger_s=0.5).start()
            fleet = []
            for i in range(clients):
                g = torch.Generator().manual_seed(i)
                x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
                data = DataSource(train=(x[:8], y[:8]), test=(x[8:], y[8:]), num_classes=10)
                fleet.append(FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"bench-{i}",
                                                    long_poll_s=5.0), data=data).start())
            status = srv.wait(600)
            for c in fleet:
                c.join(60)
            if status is None or not status.finished:
                raise SystemExit(f"bench_compression: the {kind} federation did not finish")
            rows = read_rows(Path(tmp) / "run")
            out[kind] = sum(r["bytes_received"] for r in rows) / sum(r["accepted"] for r in rows)
    return out


# ---- the server's CPU per client-round ----

def measure_cpu(kinds: tuple[str, ...], reps: int = 30,
                chunk_bytes: int = 1 << 20) -> tuple[dict[str, float], dict[str, float]]:
    """Median thread CPU seconds of the server's receive path of one cifar_cnn update, per kind; and of the device's
    encoding (u_i formed from the weights, plus the residual, encoded; 0 for none, which sends its weights)."""
    import numpy as np
    import torch

    from fedcore.aggregation import AggregationConfig, make_aggregator
    from fedcore.compression.codecs import Decoder, encode, flat_update
    from fedcore.compression.config import CompressionConfig
    from fedcore.models import build_model
    from fedcore.serialization import Reassembler, payload_of
    from fedserver.global_models import GlobalModels

    torch.set_num_threads(1)
    model = build_model("cifar_cnn", seed=0)
    models = GlobalModels.of(model)
    received = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    trained = {k: (v + 1e-3 * torch.randn(v.shape, generator=g)) if v.is_floating_point() else v
               for k, v in received.items()}
    update = flat_update(received, trained)
    manifest, weights = payload_of(trained)
    payloads: dict[str, tuple[Any, bytes]] = {"none": (None, weights.tobytes())}
    for kind in kinds:
        if kind != "none":
            cfg = CompressionConfig(kind=kind)
            payloads[kind] = (cfg, encode(update, None, cfg)[0].payload.tobytes())
    p = models.num_params

    def one(kind: str) -> float:
        cfg, raw = payloads[kind]
        agg = make_aggregator(AggregationConfig(), p, 1)
        view = memoryview(raw)
        t0 = time.thread_time()
        asm: Reassembler | Decoder = (Reassembler(manifest, len(raw), one_buffer=True) if cfg is None
                                      else Decoder(cfg, p, len(raw)))
        for at in range(0, len(raw), chunk_bytes):
            asm.feed(at, view[at:at + chunk_bytes])
        got = asm.finish()
        flat = got if isinstance(got, torch.Tensor) else models.flatten_update(got, False, consume=True)
        if not bool(np.isfinite(flat.numpy()).all()):
            raise AssertionError(kind)
        agg.add(flat, 10.0, key="c")
        return time.thread_time() - t0

    residual = 1e-4 * torch.randn(p, generator=g)

    def device(kind: str) -> float:
        cfg = payloads[kind][0]
        if cfg is None:
            return 0.0
        t0 = time.thread_time()
        encode(flat_update(received, trained), residual, cfg)
        return time.thread_time() - t0

    times: dict[str, list[float]] = {k: [] for k in kinds}
    device_times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(reps):  # interleaved: a load change on the machine hits every kind alike
        for kind in kinds:
            times[kind].append(one(kind))
            device_times[kind].append(device(kind))
    return ({k: statistics.median(v) for k, v in times.items()},
            {k: statistics.median(v) for k, v in device_times.items()})


def bench(args: argparse.Namespace) -> int:
    kinds = tuple(args.kinds)
    if "none" not in kinds:
        kinds = ("none", *kinds)
    print(f"# bench_compression {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; cifar_cnn (940,362 params)",
          flush=True)
    sizes = measure_bytes(kinds)
    cpu, dev = measure_cpu(kinds, args.reps)
    fp32 = sizes["none"]
    print("| kind | bytes / client-round | vs fp32 | server CPU / client-round (ms) | vs none | device encode (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in kinds:
        print(f"| {kind} | {sizes[kind]:,.0f} | {100 * sizes[kind] / fp32:.2f}% | {1e3 * cpu[kind]:.2f} | "
              f"{cpu[kind] / cpu['none']:.2f}x | {1e3 * dev[kind]:.1f} |")
    if "int8" in kinds:
        ok = sizes["int8"] <= INT8_GOAL * fp32
        print(f"goal int8 <= {INT8_GOAL:.0%} of fp32: {'met' if ok else 'NOT met'} "
              f"({100 * sizes['int8'] / fp32:.2f}%)")
    return 0


# ---- accuracy on the MNIST NFL environment ----

def _spec(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    spec: dict[str, Any] = {"experiment": "compression", "config": CONFIG, "kind": kind, "seed": args.seed,
                            "rounds": args.rounds, "private_epochs": args.private_epochs, "nfl_mode": "off"}
    if kind == "topk":
        spec["topk_fraction"] = args.topk_fraction
    return spec


def _command(kind: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "fedlaunch", "--config", CONFIG, "--run-dir", str(run_dir), "--seed",
           str(args.seed), "--procs", str(args.procs), "--nfl-mode", "off", "--rounds", str(args.rounds),
           "--private-epochs", str(args.private_epochs), "--server-set", "rounds.sampling_timeout_s=3600.0",
           "--server-set", f"compression.kind='{kind}'"]
    if kind == "topk":
        cmd += ["--server-set", f"compression.topk_fraction={args.topk_fraction}"]
    return cmd


def accuracy(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    try:
        for kind in args.kinds:
            run_dir = out / f"{kind}-s{args.seed}"
            spec = _spec(kind, args)
            state = run_state(run_dir, spec)
            print(f"{run_dir.name}: {state}", flush=True)
            if state != "finished":
                jobs.append(Job(run_dir.name, run_dir, _command(kind, args, run_dir), spec, args.rounds))
    except RunDirError as e:
        print(f"bench_compression: {e}", file=sys.stderr)
        return 2
    run_jobs(jobs, 1, args.timeout, log=lambda line: print(line, flush=True))
    return summary(out)


def summary(out: Path) -> int:
    """The accuracy table of a campaign directory (every ``<kind>-s<seed>`` run in it)."""
    rows_of: dict[str, list[dict[str, Any]]] = {}
    for run_dir in sorted(out.glob("*-s*")):
        rows = read_rows(run_dir)
        if rows:
            rows_of[run_dir.name] = rows
    if not rows_of:
        print(f"bench_compression: no runs in {out}", file=sys.stderr)
        return 1
    base = next((r for name, r in rows_of.items() if name.startswith("none-")), None)
    base_last = finite_mean([r["central_accuracy"] for r in base[-LAST:]]) if base else math.nan
    print("| run | rounds | final central acc | last-10 central acc | vs none (points) | median of last 10 | "
          "last-50 mean | bytes / client-round |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, rows in rows_of.items():
        acc = [r["central_accuracy"] for r in rows]
        last = finite_mean(acc[-LAST:])
        per = sum(r.get("bytes_received", 0) for r in rows) / max(1, sum(r["accepted"] for r in rows))
        gap = 100 * (last - base_last) if base is not None and len(rows) == len(base) else math.nan
        print(f"| {name} | {len(rows)} | {acc[-1]:.4f} | {last:.4f} | {'-' if math.isnan(gap) else f'{gap:+.2f}'} | "
              f"{statistics.median(acc[-LAST:]):.4f} | {finite_mean(acc[-50:]):.4f} | {per:,.0f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--reps", type=int, default=30, help="repetitions of the CPU measurement (median)")
    ap.add_argument("--accuracy", action="store_true", help="the MNIST NFL accuracy campaign (resumable)")
    ap.add_argument("--summary", default="", metavar="DIR", help="print the accuracy table of a campaign")
    ap.add_argument("--out", default="runs/compression_acc")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--private-epochs", type=int, default=0)
    ap.add_argument("--procs", type=int, default=2, help="client processes per run")
    ap.add_argument("--topk-fraction", type=float, default=0.01)
    ap.add_argument("--timeout", type=float, default=0.0, help="stop a run after this many seconds (resumable)")
    args = ap.parse_args(argv)
    if args.summary:
        return summary(Path(args.summary))
    if args.accuracy:
        return accuracy(args)
    return bench(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main", "measure_bytes", "measure_cpu", "summary"]
