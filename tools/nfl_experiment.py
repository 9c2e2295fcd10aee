"""FL-GUARD acceptance experiment: FedAvg vs detect-and-recover vs always-recover vs 50% holdouts, NFL vs ideal.

    python tools/nfl_experiment.py run --out runs/nfl_exp --seeds 0 1 2 --parallel 8 [--rounds 150] [--nr 20]
    python tools/nfl_experiment.py summarize runs/nfl_exp --md docs/results/nfl_acceptance.md

``run`` launches every (environment, arm, seed) as its own federation (``fedguard-launch --config
configs/mnist_{nfl,ideal}.toml``, real fedserver and virtual fedclient processes over loopback), ``--parallel`` at a
time, each in ``OUT/<env>-<arm>-s<seed>/``. Arms: ``fedavg`` (nfl.mode = off), ``detect`` (detect-and-recover),
``always`` (always-recover), ``holdouts`` (detect-and-recover, 50% of the benign clients opt out); for the recovery
methods side by side also ``fedprox`` and ``lindt``, ``ditto``, ``apfl``, ``ft``, ``fb`` (detect-and-recover with that
``[recovery] method``). NR and c are
scaled to the run (``--nr``, ``--c``). A run that exceeds ``--timeout`` is stopped; its completed rounds stay in
its ``rounds.jsonl`` (the server persists every round) and the summary says how many rounds it reached; running
the same command again resumes every unfinished run from its last completed round (``fedguard.launch --resume``) and
skips finished ones, so a machine with a per-command time limit completes the experiment over several commands.

``summarize`` reads every run's ``rounds.jsonl`` and prints one row per (environment, arm, client group), means
over seeds of the last 10 rounds' values:
- ``acc``: benign local accuracy of the model each client infers with (vᵢ while/after adapting, else w^{r-1});
- ``beta``: benign β = mean(Vᵢ − Pᵢ) on the clients' full test splits (FL-GUARD Eq. 1–2, αᵢ = 1/N);
- ``|β̂−β|``: mean |β̂ᵢ − βᵢ| over the run (how well the first-batch β̂ᵢ tracks βᵢ);
- ``detect`` / ``cancel``: the first round with NFL reported, the first round with the report cancelled;
- ``compute``: the clients' training seconds per round relative to the same seed's FedAvg run.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.runs import child_env, finished, finite_mean, fmt, read_rows  # noqa: E402

ENVS = {"nfl": "configs/mnist_nfl.toml", "ideal": "configs/mnist_ideal.toml"}
ARMS = {
    "fedavg": ["--nfl-mode", "off"],
    "detect": ["--nfl-mode", "detect-and-recover"],
    "always": ["--nfl-mode", "always-recover"],
    "holdouts": ["--nfl-mode", "detect-and-recover", "--holdouts", "0.5"],
}
# The recovery methods side by side (issue 11; LINDT Table 3, FL-GUARD §5.2-5.4): each detect-and-recover with the
# method announced by the server ([recovery] method); FedProx is FedAvg with the proximal term.
METHOD_ARMS = {
    "fedprox": ["--nfl-mode", "off", "--server-set", "training.prox_mu=0.01"],
    **{m: ["--nfl-mode", "detect-and-recover", "--server-set", f"recovery.method='{m}'"]
       for m in ("lindt", "ditto", "apfl", "ft", "fb")},
}
ALL_ARMS = {**ARMS, **METHOD_ARMS}


def _launch_cmd(env: str, arm: str, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "fedguard.launch", "--config", ENVS[env], "--run-dir", str(run_dir), "--seed",
           str(seed), "--procs", str(args.procs), *ALL_ARMS[arm], "--server-set", f"nfl.nr={args.nr}",
           "--server-set", f"nfl.c={args.c}",
           # round 1 waits for all N clients, which first train their private models: give them time
           "--server-set", f"rounds.sampling_timeout_s={args.sampling_timeout}"]
    if (run_dir / "state").is_dir():
        cmd.append("--resume")  # a run stopped at the time limit goes on from its last completed round
    if args.rounds:
        cmd += ["--rounds", str(args.rounds)]
    if args.private_epochs is not None:
        cmd += ["--private-epochs", str(args.private_epochs)]
    if args.device:
        cmd += ["--device", args.device]
    return cmd


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(e, a, s) for s in args.seeds for e in args.envs for a in args.arms]
    env = child_env()
    running: list[tuple[str, subprocess.Popen[bytes], float, Any]] = []
    t0 = time.monotonic()
    while jobs or running:
        while jobs and len(running) < args.parallel:
            e, a, s = jobs.pop(0)
            name = f"{e}-{a}-s{s}"
            run_dir = out / name
            if finished(run_dir):
                print(f"[{time.monotonic() - t0:7.1f}s] {name} already finished", flush=True)
                continue
            run_dir.mkdir(parents=True, exist_ok=True)
            log = open(run_dir / "launch.txt", "wb")  # noqa: SIM115 (closed when the run ends)
            p = subprocess.Popen(_launch_cmd(e, a, s, args, run_dir), stdout=log, stderr=subprocess.STDOUT,
                                 env=env, cwd=ROOT, start_new_session=True)
            running.append((name, p, time.monotonic(), log))
            print(f"[{time.monotonic() - t0:7.1f}s] started {name}", flush=True)
        time.sleep(1.0)
        for item in list(running):
            name, p, started, log = item
            over = args.timeout and time.monotonic() - started > args.timeout
            if p.poll() is None and over:
                os.killpg(p.pid, 15)  # the server exits 4 (resumable); its completed rounds are on disk
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait()
                print(f"[{time.monotonic() - t0:7.1f}s] stopped {name} at the time limit", flush=True)
            if p.poll() is not None:
                log.close()
                running.remove(item)
                print(f"[{time.monotonic() - t0:7.1f}s] {name} exit {p.returncode}", flush=True)
    return 0


def _tail(rows: list[dict[str, Any]], key: str, last: int = 10) -> float:
    return finite_mean([r.get(key, math.nan) for r in rows[-last:]])


def _first(rows: list[dict[str, Any]], pred: Any) -> int | None:
    return next((int(r["round"]) for r in rows if pred(r)), None)


def _cancel_round(rows: list[dict[str, Any]]) -> int | None:
    for prev, r in itertools.pairwise(rows):
        if prev.get("nfl") == "reported" and r.get("nfl") == "watching":
            return int(r["round"])
    return None


def summarize(args: argparse.Namespace) -> int:
    base = Path(args.dir)
    runs = {p.name: read_rows(p) for p in sorted(base.iterdir()) if p.is_dir()}
    lines = ["| env | arm | clients | seeds | rounds | central acc | acc | beta | mean abs(beta_hat - beta) | "
             "detect round | cancel round | compute vs FedAvg | passes vs vanilla |", "|" + " --- |" * 13]
    for env in ENVS:
        for arm in ALL_ARMS:
            groups = [("adapting", "test_accuracy_adapting", "beta_adapting"),
                      ("holdouts", "test_accuracy_holdout", "beta_holdout")] if arm == "holdouts" else [
                ("benign", "test_accuracy_benign", "beta_benign")]
            names = sorted(n for n in runs if n.startswith(f"{env}-{arm}-s") and runs[n])
            if not names:
                continue
            for group, acc_key, beta_key in groups:
                accs, betas, errs, dets, cans, comp, nrounds, central, passes = [], [], [], [], [], [], [], [], []
                for n in names:
                    rows = runs[n]
                    seed = n.rsplit("-s", 1)[1]
                    accs.append(_tail(rows, acc_key))
                    central.append(_tail(rows, "central_accuracy"))
                    passes.append(finite_mean([r.get("client_passes", math.nan) for r in rows]))
                    betas.append(_tail(rows, beta_key))
                    errs.append(finite_mean([r.get("beta_hat_error", math.nan) for r in rows]))
                    dets.append(_first(rows, lambda r: r.get("nfl") == "reported"))
                    cans.append(_cancel_round(rows))
                    nrounds.append(len(rows))
                    ref = runs.get(f"{env}-fedavg-s{seed}", [])
                    mine = finite_mean([r.get("client_seconds", math.nan) for r in rows])
                    theirs = finite_mean([r.get("client_seconds", math.nan) for r in ref])
                    comp.append(mine / theirs if theirs and not math.isnan(theirs) else math.nan)
                lines.append(
                    f"| {env} | {arm} | {group} | {len(names)} | {'/'.join(map(str, nrounds))} | "
                    f"{fmt(finite_mean(central))} | {fmt(finite_mean(accs))} | {fmt(finite_mean(betas))} | "
                    f"{fmt(finite_mean(errs))} | "
                    f"{'/'.join('-' if d is None else str(d) for d in dets)} | "
                    f"{'/'.join('-' if c is None else str(c) for c in cans)} | {fmt(finite_mean(comp), 2)}x | "
                    f"{fmt(finite_mean(passes), 2)}x |")
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.plot:
        _plot(runs, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def _plot(runs: dict[str, list[dict[str, Any]]], out: Path) -> None:
    """Benign local accuracy and benign β per round, mean over seeds, one line per arm, one column per env."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'fedguard[plot]'") from None
    envs = [e for e in ENVS if any(n.startswith(f"{e}-") for n in runs)]
    fig, axes = plt.subplots(2, len(envs), figsize=(6 * len(envs), 7), squeeze=False)
    for col, env in enumerate(envs):
        for arm in ALL_ARMS:
            names = [n for n in runs if n.startswith(f"{env}-{arm}-s") and runs[n]]
            if not names:
                continue
            key_acc, key_beta = (("test_accuracy_adapting", "beta_adapting") if arm == "holdouts"
                                 else ("test_accuracy_benign", "beta_benign"))
            for row, key in enumerate((key_acc, key_beta)):
                by_round: dict[int, list[float]] = {}
                for n in names:
                    for r in runs[n]:
                        by_round.setdefault(int(r["round"]), []).append(r.get(key, math.nan))
                xs = sorted(by_round)
                axes[row][col].plot(xs, [finite_mean(by_round[x]) for x in xs], label=arm, linewidth=1.2)
        axes[0][col].set_title(f"{env}: benign local accuracy (mean over seeds)")
        axes[1][col].set_title(f"{env}: benign beta")
        axes[1][col].axhline(0.0, color="grey", linewidth=0.6)
        for row in (0, 1):
            axes[row][col].set_xlabel("round")
            axes[row][col].legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", default="runs/nfl_exp")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ALL_ARMS),
                   help="default: the FL-GUARD arms; the methods comparison adds fedprox lindt ditto apfl ft fb")
    r.add_argument("--parallel", type=int, default=2)
    r.add_argument("--procs", type=int, default=1, help="client processes per run")
    r.add_argument("--rounds", type=int, default=0, help="0: the config's (150)")
    r.add_argument("--private-epochs", type=int, default=None)
    r.add_argument("--nr", type=int, default=20)
    r.add_argument("--c", type=int, default=20)
    r.add_argument("--timeout", type=float, default=0.0, help="stop a run after this many seconds (0: never)")
    r.add_argument("--device", default="")
    r.add_argument("--sampling-timeout", type=float, default=3600.0,
                   help="rounds.sampling_timeout_s: how long round 1 waits for the fleet (private models first)")
    s = sub.add_parser("summarize")
    s.add_argument("dir")
    s.add_argument("--md", default="")
    s.add_argument("--plot", default="", help="write a PNG of accuracy and beta per round (needs matplotlib)")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else summarize(args)


if __name__ == "__main__":
    sys.exit(main())
