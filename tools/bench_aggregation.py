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

    python tools/bench_aggregation.py            # K in {10, 100}, P in {1e6, 1e7}
    python tools/bench_aggregation.py --quick    # K = 10, P = 1e5: a smoke run in seconds

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
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedcore.aggregation import AggregationConfig, BufferedAggregator, build_rule, estimate_memory, make_aggregator

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
        "trimmed_mean": replace(base, rule="trimmed_mean", trim_fraction=0.1),
        "trimmed_mean+dp": replace(base, rule="trimmed_mean", trim_fraction=0.1, **dp),  # type: ignore[arg-type]
        "krum": replace(base, rule="krum", krum_f=f),
        "multi_krum": replace(base, rule="multi_krum", krum_f=f),
        "bulyan": replace(base, rule="bulyan", krum_f=f),
        "knorm": replace(base, rule="knorm", knorm_k=max(1, k // 10)),
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
                m = int((cfg.trim_fraction or 0.0) * k)
                ref = np.sort(arr, axis=0)[m : k - m].mean(axis=0)
            out["numpy_s"] = time.perf_counter() - t0
            out["np_ratio"] = out["numpy_s"] / out["rule_s"]
            out["max_abs_diff"] = float(np.abs(ref - step.numpy()).max())
    return out


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
