"""Checks tools/bench/scaling_model.py's prediction for two shard counts on this machine (issue 30, item 6).

One invocation, so that the model's inputs and the check see the same load:

1. **Calibrate**: tools/bench/scaling_model.py's short runs measure F, a, b, i, d, L, the wire bytes and bandwidths.
2. **Shards**: for each S (default 1 and 2), S fedserver processes run at once, each owning N/S virtual clients
   (their own client-host processes) and selecting K/S per round; no-op trainer, the 4.5k-parameter MLP. The
   model predicts each shard's wall seconds per round, its server CPU per round and the client-rounds per second
   of all shards together for this machine's cores (servers and clients share them: ``predict_shared``); the
   measurement is taken over the window in which every shard was running rounds.
3. **Root**: the step a hierarchical coordinator adds, measured here because fedserver has no shard mode:
   (a) the combine: S partial exact sums (fedcore's FixedPointSum, int64 accumulators, 16 bytes per parameter)
   added and divided into the FedAvg mean, checked bit for bit against one sum over all updates; (b) the exchange:
   the model's wire frames sent to S shards and their partial sums received back over loopback TCP. Both are
   compared with what the bandwidths measured in step 1 predict (a lower bound: the bytes moved / the bandwidth).

What the prototype leaves out: the shards run independent federations (no root barrier between their rounds,
no model exchange inside fedserver); the root's steps are measured beside them, not in the loop, and the
global round a synchronous root would run is *computed* as shard round + combine + exchange.

    python tools/prototypes/shard_prototype.py                    # S = 1 and 2, N = 96, K = 48 (3-5 minutes on 2 cores)
    python tools/prototypes/shard_prototype.py --shards 2 4 --clients 96 -k 48
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.scaling_model import (  # noqa: E402
    SMALL,
    Costs,
    ShardRun,
    SharedPrediction,
    calibrate,
    combine_fixed_point,
    predict_shared,
    print_inputs,
    run_fleet,
)


@dataclass(frozen=True)
class Measured:
    shards: int
    wall_per_round: float  # mean over shards, in the common window
    server_cpu: float  # median over shards of their median server CPU per round
    client_rounds_per_s: float
    window_s: float
    rounds_in_window: int
    overlapped: bool = True  # every shard completed rounds in the common window


def common_window(runs: Sequence[ShardRun], min_rounds: int = 5) -> Measured:
    """Each shard's rounds per second over the window in which all shards were completing rounds (from the
    latest first timed completion to the earliest last one). Shards start when their own clients have joined,
    so on a busy machine their runs can be skewed by seconds: if that window holds fewer than ``min_rounds``
    rounds of some shard, the shards did not run concurrently; the whole runs' figures are returned, marked
    ``overlapped=False`` (not a check of the model)."""
    t0 = max(r.completions[0] for r in runs)
    t1 = min(r.completions[-1] for r in runs)
    inside = [[t for t in r.completions if t0 <= t <= t1] for r in runs]
    overlapped = all(len(x) >= min_rounds + 1 for x in inside)
    per_round: list[float] = []
    rate = 0.0
    counted = 0
    for r, x in zip(runs, inside, strict=True):
        if overlapped:
            wall = (x[-1] - x[0]) / (len(x) - 1)
            counted += len(x) - 1
        else:
            wall = r.wall_per_round
            counted += r.rounds
        per_round.append(wall)
        rate += r.k / wall
    return Measured(len(runs), statistics.mean(per_round), statistics.median(r.server_cpu for r in runs), rate,
                    max(0.0, t1 - t0), counted, overlapped)


def rel(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+6.1f}%" if meas else "   n/a"


# ---------------------------------------------------------------- the root's steps


def measure_combine(shards: int, params: int, k_total: int, reps: int = 5) -> tuple[float, bool]:
    """Median seconds of the root's combine (S partial exact sums added, the mean formed) and whether the result
    equals, bit for bit, one exact sum over all K updates."""
    from fedcore.aggregation.fixedpoint import FixedPointSum

    g = torch.Generator().manual_seed(1234 + shards)
    updates = torch.randn(k_total, params, generator=g) * 0.01
    weights = torch.randint(1, 100, (k_total,), generator=g).to(torch.float64)
    whole = FixedPointSum(params, workers=1)
    for u, w in zip(updates, weights, strict=True):
        whole.add(u, float(w))
    parts = []
    for s in range(shards):
        part = FixedPointSum(params, workers=1)
        for j in range(s, k_total, shards):  # shard s owns every S-th client
            part.add(updates[j], float(weights[j]))
        parts.append(part)
    total_w = float(weights.sum())
    times = []
    mean = torch.empty(0)
    for _ in range(reps):
        t0 = time.perf_counter()
        mean = combine_fixed_point(parts).value(total_w)
        times.append(time.perf_counter() - t0)
    exact = bool(torch.equal(mean, whole.value(total_w)))
    return statistics.median(times), exact


def measure_exchange(shards: int, params: int, reps: int = 3) -> float:
    """Median seconds for the root to send the model's wire frames to S shards and receive S partial sums (16
    bytes per parameter: the two int64 accumulators) back over loopback TCP; each shard is a thread here that
    reads the model and answers with its partial (the shards' own work is not in it)."""
    from fedcore.serialization import payload_of
    from fedguard import wire
    from fedguard.v1 import fedguard_pb2 as pb

    state = {"w": torch.randn(params, generator=torch.Generator().manual_seed(7))}
    partial = bytes(16 * params)
    times = []
    for _ in range(reps):
        pairs = [socket.socketpair() for _ in range(shards)]

        def shard(sock: socket.socket, model_bytes: int) -> None:
            buf = bytearray(1 << 20)
            got = 0
            while got < model_bytes:
                got += sock.recv_into(buf)
            sock.sendall(partial)

        t0 = time.perf_counter()
        manifest, payload = payload_of(state)
        header = pb.TaskMessage(header=pb.TaskHeader(tensors=wire.metas_to_pb(manifest), total_bytes=len(payload)))
        frames = [header.SerializeToString(), *wire.chunk_frame_bytes(payload, pb.TaskMessage)]
        size = sum(map(len, frames))
        threads = [threading.Thread(target=shard, args=(b, size)) for _, b in pairs]
        for th in threads:
            th.start()
        for a, _ in pairs:
            for f in frames:
                a.sendall(f)
        buf = bytearray(1 << 20)
        for a, _ in pairs:
            got = 0
            while got < len(partial):
                got += a.recv_into(buf)
        times.append(time.perf_counter() - t0)
        for th in threads:
            th.join()
        for a, b in pairs:
            a.close()
            b.close()
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, nargs=2, default=[1, 2], help="the two shard counts to check")
    ap.add_argument("--clients", type=int, default=96, help="N, all shards together")
    ap.add_argument("-k", type=int, default=48, help="K per round, all shards together")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds of each shard")
    ap.add_argument("--hosts", type=int, default=2, help="client-host processes per shard")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each shard count, alternating their order")
    ap.add_argument("--calibration-rounds", type=int, default=6)
    ap.add_argument("--root-params", type=int, nargs="*", default=[1_000_000], help="model sizes for the root")
    args = ap.parse_args()
    for s in args.shards:
        if args.clients % s or args.k % s:
            ap.error(f"N and K must divide by every shard count ({s})")
    torch.set_num_threads(1)
    cores = float(os.cpu_count() or 1)
    started = time.monotonic()
    cal = calibrate(args.calibration_rounds)
    c: Costs = cal.costs
    print_inputs(cal)
    print(f"\nshards on this machine ({cores:g} cores shared by the servers and the client hosts), N = {args.clients},"
          f" K = {args.k}, {args.rounds} timed rounds per shard, no-op trainer, 4,554-parameter MLP:")
    measured: dict[int, list[Measured]] = {s: [] for s in args.shards}
    predicted: dict[int, list[SharedPrediction]] = {s: [] for s in args.shards}
    proto_params = 0
    free: dict[int, list[float]] = {s: [] for s in args.shards}
    for rep in range(args.repeat):
        for s in args.shards if rep % 2 == 0 else reversed(args.shards):  # alternate the order against drift
            n, k = args.clients // s, args.k // s
            runs = run_fleet([(n, k)] * s, SMALL, args.rounds, args.hosts)
            proto_params = runs[0].params
            measured[s].append(common_window(runs))
            # the cores other sessions' processes left us while these shards ran (measured, /proc/stat)
            free[s].append(max(0.25, cores - statistics.median(r.others_cores for r in runs)))
            predicted[s].append(predict_shared(c, s, n, k, proto_params, free[s][-1], args.hosts))
            for j, r in enumerate(runs):
                print(f"  rep {rep} S = {s} shard {j}: n = {r.n}, k = {r.k}, median round {r.round_s:.4f} s, "
                      f"wall/round {r.wall_per_round:.4f} s, server CPU/round {r.server_cpu:.4f} s, client-host "
                      f"CPU/round {r.client_cpu_per_round:.4f} s, other load {r.others_cores:.2f} cores, server "
                      f"RssAnon {r.server_anon / 2**20:.0f} MiB")
    print(f"\n  {'S':>2} {'rep':>3} {'':<24} {'predicted':>10} {'measured':>10} {'error':>8}")
    for s in args.shards:
        for rep, (p, m) in enumerate(zip(predicted[s], measured[s], strict=True)):
            print(f"  {s:2d} {rep:3d} {'wall s per shard round':<24} {p.round_s:10.4f} {m.wall_per_round:10.4f} "
                  f"{rel(p.round_s, m.wall_per_round)}   (window {m.window_s:.2f} s, {m.rounds_in_window} rounds; "
                  f"cores left by other load {free[s][rep]:.2f})"
                  + ("" if m.overlapped else "  NOT CONCURRENT: the shards' runs did not overlap, left out below"))
            print(f"  {s:2d} {rep:3d} {'server CPU s per round':<24} {p.server_cpu:10.4f} {m.server_cpu:10.4f} "
                  f"{rel(p.server_cpu, m.server_cpu)}")
            print(f"  {s:2d} {rep:3d} {'client-rounds per s':<24} {p.client_rounds_per_s:10.1f} "
                  f"{m.client_rounds_per_s:10.1f} {rel(p.client_rounds_per_s, m.client_rounds_per_s)}")
    valid = {s: [j for j, m in enumerate(measured[s]) if m.overlapped] or list(range(len(measured[s])))
             for s in args.shards}
    med_p = {s: statistics.median(predicted[s][j].client_rounds_per_s for j in valid[s]) for s in args.shards}
    med_m = {s: statistics.median(measured[s][j].client_rounds_per_s for j in valid[s]) for s in args.shards}
    for s in args.shards:
        print(f"  S = {s}: client-rounds per s, median over {len(valid[s])} concurrent reps: predicted "
              f"{med_p[s]:.1f}, measured {med_m[s]:.1f} ({rel(med_p[s], med_m[s]).strip()})")
    a, b = args.shards
    print(f"  speed-up S = {a} -> {b} (median client-rounds per s): predicted {med_p[b] / med_p[a]:.2f}x, measured "
          f"{med_m[b] / med_m[a]:.2f}x")

    print("\nthe root (not in fedserver: measured beside the shards; bound = bytes moved / measured bandwidth; "
          "global round = predicted shard round at that size + combine + exchange):")
    print(f"  {'S':>2} {'params':>10} {'combine s':>10} {'bound':>9} {'exact':>5} {'exchange s':>10} {'bound':>9}  "
          f"{'global round (sync root)':>24}")
    for params in sorted({*args.root_params, proto_params}):
        for s in args.shards:
            comb, exact = measure_combine(s, params, args.k)
            exch = measure_exchange(s, params)
            # combine: per shard two int64 adds (read 2 x 8P, write 8P, twice) + the mean (read 16P, write 4P)
            comb_bound = (48 * s * params + 20 * params) / c.memcpy_bandwidth
            exch_bound = s * (c.wire_bytes_per_param / 2 * params + 16 * params) / c.bandwidth
            glob = predict_shared(c, s, args.clients // s, args.k // s, params, statistics.median(free[s]),
                                  args.hosts).round_s
            glob += comb + exch
            print(f"  {s:2d} {params:10,d} {comb:10.5f} {comb_bound:9.5f} {'yes' if exact else 'NO':>5} {exch:10.5f} "
                  f"{exch_bound:9.5f}  {glob:24.4f}")
    print(f"(calibration, shards and root measured in {time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
