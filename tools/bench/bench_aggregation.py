"""Time and peak memory of one aggregation round for every rule (fedcore.aggregation).

For each rule variant and each K (updates per round) and P (parameters), a fresh subprocess:
  1. builds a pool of 8 random [P] float32 updates (not counted), then resets the process's RSS high-water
     mark (``/proc/self/clear_refs``; falls back to ``ru_maxrss`` deltas where that is not allowed);
  2. make_aggregator(config, P, K) and K x add(update, n_i) (each update a distinct perturbation of a pool
     vector): "add s" is the summed time of the add calls, "add GB/s" = K*P*4 bytes / add s;
  3. finalize(w^{r-1}, generator): "finalize s" (rule + noise + metrics incl. w_div);
  4. "peak MB": the increase of the RSS high-water mark over the RSS before make_aggregator, i.e. what the
     aggregation itself cost; "est MB": fedcore.aggregation.estimate_memory for the same configuration;
  5. for buffered rules, "rule s": the rule alone on the buffer; for median and trimmed_mean, the same
     statistic with numpy (np.median / np.sort-based trimmed mean) on the same [K, P] rows, "np/torch" =
     numpy time / torch rule time, and the largest absolute difference of the two results.
Combinations whose memory (estimate, plus a [K, P] copy for the numpy comparison) exceeds --max-gb are
skipped and listed as such.

    python tools/bench/bench_aggregation.py            # K in {10, 100}, P in {1e6, 1e7}
    python tools/bench/bench_aggregation.py --quick    # K = 10, P = 1e5: a smoke run in seconds
    python tools/bench/bench_aggregation.py --fedavg-throughput   # exact streaming FedAvg add() vs a float32 sum

``--fedavg-throughput`` (in this process, for each P in ``--ps`` and each torch thread count in
``--fp-threads``; K = 10 distinct updates, ``--reps`` repetitions, median): GB/s of float32 update bytes
(K*P*4 / time of the K calls) of a plain float32 running sum ``sum.add_(u, alpha=w)`` (the old, arrival-order
dependent StreamingFedAvg), of the exact fixed-point sum alone (fedcore.aggregation.fixedpoint), and of
the whole StreamingFedAvg.add() (validation, range check, exact sum) without and with the w_div sketch.
It then checks that the K updates added in reverse order give a bit-identical global model.

Run it with ``nice`` on a shared machine; timings on a loaded machine vary by 2x between runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedcore.aggregation import (
    AggregationConfig,
    BufferedAggregator,
    KNormOptions,
    KrumOptions,
    MultiKrumOptions,
    StreamingFedAvg,
    TrimmedMeanOptions,
    build_rule,
    estimate_memory,
    make_aggregator,
)
from fedcore.aggregation.fixedpoint import FixedPointSum
from fedcore.registry import options_as

VARIANTS = [
    "fedavg", "fedavg+dp", "fedavg-exact", "median", "trimmed_mean", "trimmed_mean+dp",
    "krum", "multi_krum", "bulyan", "knorm",
]
NUMPY_RULES = {"median", "trimmed_mean", "trimmed_mean+dp"}
POOL = 8


def variant_config(name: str, k: int) -> AggregationConfig:
    f = 1 if k < 50 else k // 10
    dp = {"clip_norm": 15.0, "noise_sigma": 0.001, "weighted": False}
    base = AggregationConfig(max_update_norm=math.inf)
    configs: dict[str, AggregationConfig] = {
        "fedavg": base,
        "fedavg+dp": replace(base, **dp),  # type: ignore[arg-type]
        "fedavg-exact": replace(base, exact_metrics=True),
        "median": replace(base, rule="median"),
        "trimmed_mean": replace(base, rule="trimmed_mean", options=TrimmedMeanOptions(trim_fraction=0.1)),
        "trimmed_mean+dp": replace(base, rule="trimmed_mean", options=TrimmedMeanOptions(trim_fraction=0.1),
                                   **dp),  # type: ignore[arg-type]
        "krum": replace(base, rule="krum", options=KrumOptions(krum_f=f)),
        "multi_krum": replace(base, rule="multi_krum", options=MultiKrumOptions(krum_f=f)),
        "bulyan": replace(base, rule="bulyan", options=KrumOptions(krum_f=f)),
        "knorm": replace(base, rule="knorm", options=KNormOptions(knorm_k=max(1, k // 10))),
    }
    return configs[name]


# ---- memory probes (Linux /proc, with a getrusage fallback) ----


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _maxrss_kb() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


# ---- one configuration, in a fresh process ----


def run_child(variant: str, k: int, p: int, seed: int, with_numpy: bool) -> dict[str, Any]:
    cfg = variant_config(variant, k)
    gen = torch.Generator().manual_seed(seed)
    pool = [torch.randn(p, generator=gen) * 0.01 for _ in range(POOL)]
    glob = torch.zeros(p)
    weights = [float(10 + (i * 37) % 50) for i in range(k)]
    hwm_reset = _reset_peak()
    base_kb = _status_kb("VmRSS") if hwm_reset else _maxrss_kb()
    agg = make_aggregator(cfg, num_params=p, k=k)
    add_s = 0.0
    for i in range(k):
        u = pool[i % POOL]
        u.add_(1e-4)  # distinct updates without allocating
        t0 = time.perf_counter()
        agg.add(u, weights[i])
        add_s += time.perf_counter() - t0
    t0 = time.perf_counter()
    res = agg.finalize(glob, torch.Generator().manual_seed(seed + 1))
    finalize_s = time.perf_counter() - t0
    peak_kb = (_status_kb("VmHWM") if hwm_reset else _maxrss_kb()) or 0
    out: dict[str, Any] = {
        "variant": variant, "k": k, "p": p, "mode": "buffered" if isinstance(agg, BufferedAggregator) else "streaming",
        "add_s": add_s, "add_gbps": k * p * 4 / add_s / 1e9, "finalize_s": finalize_s,
        "peak_mb": max(0, peak_kb - (base_kb or 0)) * 1024 / 1e6, "peak_probe": "VmHWM" if hwm_reset else "ru_maxrss",
        "est_mb": estimate_memory(cfg, k, p).total_bytes / 1e6,
        "w_div": res.metrics.get("w_div", float("nan")), "threads": torch.get_num_threads(),
    }
    if isinstance(agg, BufferedAggregator):
        rows = agg.rows
        rule = build_rule(cfg)
        w = torch.tensor(weights, dtype=torch.float64)
        t0 = time.perf_counter()
        step = rule(rows, w).step
        out["rule_s"] = time.perf_counter() - t0
        if with_numpy and variant in NUMPY_RULES:
            arr = rows.numpy()
            t0 = time.perf_counter()
            if cfg.rule == "median":
                ref = np.median(arr, axis=0)
            else:
                m = int((options_as(cfg.options, TrimmedMeanOptions, "options").trim_fraction or 0.0) * k)
                ref = np.sort(arr, axis=0)[m : k - m].mean(axis=0)
            out["numpy_s"] = time.perf_counter() - t0
            out["np_ratio"] = out["numpy_s"] / out["rule_s"]
            out["max_abs_diff"] = float(np.abs(ref - step.numpy()).max())
    return out


# ---- exact streaming FedAvg: add() throughput ----

FP_COLUMNS = ("float32 add_", "exact sum", "Streaming.add", "+sketch")


def _gbps(k: int, p: int, seconds: float) -> float:
    return k * p * 4 / seconds / 1e9


def fedavg_throughput(p: int, threads: int, k: int, reps: int, sketch_dim: int, seed: int) -> dict[str, Any]:
    """Median add() throughput (GB/s of update bytes) of the four accumulations over the same K updates."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    updates = [torch.randn(p, generator=gen) * 0.01 for _ in range(k)]
    weights = [float(10 + (i * 37) % 50) for i in range(k)]
    keys = [f"client-{i:03d}" for i in range(k)]

    def plain() -> float:
        acc = torch.zeros(p, dtype=torch.float32)
        t0 = time.perf_counter()
        for u, w in zip(updates, weights, strict=True):
            acc.add_(u, alpha=w)
        return time.perf_counter() - t0

    def exact() -> float:
        acc = FixedPointSum(p)
        t0 = time.perf_counter()
        for u, w in zip(updates, weights, strict=True):
            acc.add(u, w)
        return time.perf_counter() - t0

    def streaming(d: int) -> float:
        agg = StreamingFedAvg(p, sketch_dim=d, max_update_norm=math.inf)
        t0 = time.perf_counter()
        for u, w, key in zip(updates, weights, keys, strict=True):
            agg.add(u, w, key=key)
        return time.perf_counter() - t0

    runs: dict[str, Callable[[], float]] = {
        FP_COLUMNS[0]: plain,
        FP_COLUMNS[1]: exact,
        FP_COLUMNS[2]: lambda: streaming(0),
        FP_COLUMNS[3]: lambda: streaming(sketch_dim),
    }
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):  # interleaved, so that a burst of load on the machine hits all columns alike
        for name, run in runs.items():
            samples[name].append(_gbps(k, p, run()))
    out: dict[str, Any] = {"p": p, "threads": threads, "k": k, "reps": reps}
    out.update({name: float(np.median(v)) for name, v in samples.items()})
    out.update({f"{name} min": min(v) for name, v in samples.items()})
    results = []
    for order in (range(k), reversed(range(k))):
        agg = StreamingFedAvg(p, sketch_dim=sketch_dim, max_update_norm=math.inf)
        for i in order:
            agg.add(updates[i], weights[i], key=keys[i])
        results.append(agg.finalize(torch.zeros(p)))
    out["order_independent"] = bool(torch.equal(results[0].new_global, results[1].new_global)
                                    and results[0].metrics == results[1].metrics)
    return out


def print_fedavg_throughput(rows: list[dict[str, Any]], sketch_dim: int) -> None:
    print(f"\nadd() throughput, GB/s of float32 update bytes (K={rows[0]['k']}, median of {rows[0]['reps']}; "
          f"min in parentheses); +sketch: sketch_dim={sketch_dim}")
    head = f"{'P':>9} {'threads':>7} " + " ".join(f"{c:>16}" for c in FP_COLUMNS) + f" {'order-indep.':>12}"
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = " ".join(f"{r[c]:>8.2f} ({r[c + ' min']:>5.2f})" for c in FP_COLUMNS)
        print(f"{r['p']:>9.0e} {r['threads']:>7} {cells} {'yes' if r['order_independent'] else 'NO':>12}")
    worst = min(min(r[c] for c in FP_COLUMNS[1:]) for r in rows)
    print(f"\nexact streaming FedAvg: lowest median add() throughput {worst:.2f} GB/s (goal >= 1 GB/s); columns: "
          f"{FP_COLUMNS[0]} = old float32 running sum, {FP_COLUMNS[1]} = FixedPointSum.add alone, "
          f"{FP_COLUMNS[2]} = StreamingFedAvg.add (validate + range check + exact sum), {FP_COLUMNS[3]} = with "
          f"the w_div CountSketch")


# ---- driver ----


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'rule':<16} {'K':>4} {'P':>9} {'mode':<9} {'add s':>7} {'add GB/s':>8} {'final s':>8} "
            f"{'rule s':>7} {'peak MB':>8} {'est MB':>8} {'numpy s':>8} {'np/torch':>8} {'max|diff|':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['variant']:<16} {r['k']:>4} {r['p']:>9.0e} skipped: {r['skipped']}")
            continue
        if "error" in r:
            print(f"{r['variant']:<16} {r['k']:>4} {r['p']:>9.0e} failed: {r['error']}")
            continue
        print(f"{r['variant']:<16} {r['k']:>4} {r['p']:>9.0e} {r['mode']:<9} {r['add_s']:>7.3f} "
              f"{r['add_gbps']:>8.2f} {r['finalize_s']:>8.3f} {_fmt(r.get('rule_s'), '7.3f'):>7} "
              f"{r['peak_mb']:>8.0f} {r['est_mb']:>8.0f} {_fmt(r.get('numpy_s'), '8.3f'):>8} "
              f"{_fmt(r.get('np_ratio'), '8.2f'):>8} {_fmt(r.get('max_abs_diff'), '9.1e'):>9}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes: K = 10, P = 1e5")
    ap.add_argument("--ks", default="10,100", help="comma-separated K values")
    ap.add_argument("--ps", default="1e6,1e7", help="comma-separated P values")
    ap.add_argument("--rules", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument("--max-gb", type=float, default=12.0, help="skip combinations needing more memory (GB)")
    ap.add_argument("--no-numpy", action="store_true", help="skip the numpy comparison")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads in the children (0 = torch default). Default 1: numpy's sort/partition "
                         "are single-threaded, and on a shared 2-core machine 2 OpenMP threads spin-wait on "
                         "each other and make small operations 10-100x slower")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--fedavg-throughput", action="store_true",
                    help="add() throughput of the exact streaming FedAvg vs a float32 running sum (K = 10)")
    ap.add_argument("--fp-threads", default="1,2",
                    help="--fedavg-throughput: comma-separated torch thread counts (the exact sum splits an add "
                         "over that many threads)")
    ap.add_argument("--reps", type=int, default=7, help="--fedavg-throughput: repetitions (median reported)")
    ap.add_argument("--sketch-dim", type=int, default=AggregationConfig().sketch_dim,
                    help="--fedavg-throughput: sketch width of the +sketch column")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        spec = json.loads(args.child)
        if args.threads:
            torch.set_num_threads(args.threads)
        print(json.dumps(run_child(spec["variant"], spec["k"], spec["p"], args.seed, spec["numpy"])))
        return 0

    ks = [10] if args.quick else [int(float(x)) for x in args.ks.split(",")]
    ps = [100_000] if args.quick else [int(float(x)) for x in args.ps.split(",")]
    if args.fedavg_throughput:
        thread_counts = [int(x) for x in args.fp_threads.split(",") if x.strip()]
        print(f"exact streaming FedAvg add() throughput: torch {torch.__version__}, numpy {np.__version__}, "
              f"{os.cpu_count()} CPUs", flush=True)
        tp_rows = []
        for p in ps:
            for threads in thread_counts:
                tp_rows.append(fedavg_throughput(p, threads, 10, args.reps, args.sketch_dim, args.seed))
                r = tp_rows[-1]
                print(f"  P={p:.0e} threads={threads}: " + ", ".join(f"{c} {r[c]:.2f}" for c in FP_COLUMNS),
                      flush=True)
        print_fedavg_throughput(tp_rows, args.sketch_dim)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(tp_rows, fh, indent=1)
        return 0
    variants = [v.strip() for v in args.rules.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown rule variant(s) {unknown}; known: {VARIANTS}")
    print(f"fedcore.aggregation benchmark: torch {torch.__version__}, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs, torch threads {args.threads or torch.get_num_threads()}, max {args.max_gb} GB")
    results: list[dict[str, Any]] = []
    for p in ps:
        for k in ks:
            for v in variants:
                cfg = variant_config(v, k)
                need = estimate_memory(cfg, k, p).total_bytes + POOL * p * 4
                with_numpy = not args.no_numpy and v in NUMPY_RULES
                if with_numpy:
                    need += k * p * 4  # numpy's sorted/partitioned copy of the [K, P] rows
                if need > args.max_gb * 1e9:
                    results.append({"variant": v, "k": k, "p": p,
                                    "skipped": f"needs about {need / 1e9:.1f} GB > --max-gb {args.max_gb}"})
                    print_progress(results[-1])
                    continue
                spec = json.dumps({"variant": v, "k": k, "p": p, "numpy": with_numpy})
                cmd = [sys.executable, os.path.abspath(__file__), "--child", spec, "--seed", str(args.seed),
                       "--threads", str(args.threads)]
                proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
                    results.append({"variant": v, "k": k, "p": p, "error": f"exit {proc.returncode}: {tail}"})
                else:
                    results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print_progress(results[-1])
    print()
    print_table(results)
    fedavg = [r for r in results if r.get("variant") == "fedavg" and "add_gbps" in r]
    if fedavg:
        print(f"\nstreaming FedAvg add throughput: min {min(r['add_gbps'] for r in fedavg):.2f} GB/s, "
              f"max {max(r['add_gbps'] for r in fedavg):.2f} GB/s of update bytes (goal >= 1 GB/s)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


def print_progress(r: dict[str, Any]) -> None:
    what = r.get("skipped") or r.get("error") or f"add {r['add_s']:.3f}s finalize {r['finalize_s']:.3f}s"
    print(f"  {r['variant']:<16} K={r['k']:<4} P={r['p']:.0e}: {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
