"""Server optimizers on MNIST non-IID (issue 50, item 2): FedAvg vs FedAvgM vs FedAdam vs FedYogi, as federations.

    python tools/experiments/server_opt_experiment.py run --grid --seeds 0 --out /root/campaigns/server_opt
    python tools/experiments/server_opt_experiment.py run --best-of /root/campaigns/server_opt --seeds 1 2 \\
        --out /root/campaigns/server_opt
    python tools/experiments/server_opt_experiment.py collect /root/campaigns/server_opt docs/results/server_opt
    python tools/experiments/server_opt_experiment.py summarize docs/results/server_opt \\
        --into docs/results/server_opt.md

``run`` launches, per (arm, server learning rate, seed), one federation with ``fedguard-launch --config
configs/server_opt_mnist.toml`` (a real fedserver and virtual fedclient processes on loopback, plaintext) in
``OUT/<arm>-<lr>-s<seed>/``, ``--parallel`` at a time. The arms differ only in the server's ``[server_optimizer]``
stage (the client learning rate is the config's, the same everywhere):

- ``fedavg``: no optimizer, the new model is the aggregate (x + Δ; its "server lr" is 1);
- ``fedavgm``: server momentum 0.9, x ← x + η·v (Hsu et al. 2019);
- ``fedadam``, ``fedyogi``: Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2, with
  β1 = 0.9, β2 = 0.99, τ = 1e-3, no bias correction.

Which server learning rates run: ``--grid`` the whole :data:`GRID` of each arm, ``--lr ARM=LR ...`` the ones
named, ``--best-of DIR`` each arm's best grid setting on seed 0 in ``DIR`` (the highest mean central accuracy
over the last :data:`LAST` rounds, :func:`best_lrs`). A campaign survives stops (:mod:`tools.runs`): each run keeps
a record (``record.json``); running the same command again skips finished runs and resumes unfinished ones
(``fedlaunch --resume``); ``--timeout`` stops a run after that long in one sitting (resumable).

``collect`` copies finished runs' ``rounds.jsonl`` and record out as ``NAME.rounds.jsonl`` / ``NAME.record.json``
for committing. ``summarize`` reads campaign directories, run directories or such files and prints three Markdown
tables from the global model's accuracy on the pooled test splits (``central_accuracy``): the learning-rate grid
on seed 0 (the chosen setting of each arm marked), the chosen settings on every seed (last round, mean of the
last 5, the first round reaching ``--target``; means over seeds) and the runs' wall times, then the arms' order.
``--into FILE`` writes them between FILE's ``<!-- summarize: begin -->`` and ``<!-- summarize: end -->`` lines.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.experiments.nfl_experiment import BEGIN, END, splice  # noqa: E402
from tools.runs import (  # noqa: E402
    RECORD,
    Job,
    RunDirError,
    collect_runs,
    finished,
    finite_mean,
    fmt,
    md_table,
    opt_text,
    read_record,
    read_rows,
    run_jobs,
    run_state,
)

CONFIG = "configs/server_opt_mnist.toml"
ARMS = ("fedavg", "fedavgm", "fedadam", "fedyogi")
# The server learning rates of the grid (seed 0). fedavg has none: x + Δ, i.e. η = 1. fedavgm's 3 was added after
# its 1 came out best at the grid's edge, its 10 after 3 did.
GRID: dict[str, tuple[float, ...]] = {"fedavg": (1.0,), "fedavgm": (0.1, 0.3, 1.0, 3.0, 10.0),
                                      "fedadam": (0.003, 0.01, 0.03, 0.1), "fedyogi": (0.003, 0.01, 0.03, 0.1)}
# Each optimizer's options besides lr (the whole table is set, so a run's options are all on its command line).
OPTIONS: dict[str, str] = {"fedavgm": "momentum = 0.9",
                           "fedadam": "beta1 = 0.9, beta2 = 0.99, tau = 1e-3, bias_correction = false",
                           "fedyogi": "beta1 = 0.9, beta2 = 0.99, tau = 1e-3, bias_correction = false"}
# The tables' "last 5": the mean central accuracy of the last LAST rounds; it also picks each arm's grid setting.
LAST = 5
# The accuracy whose first round the tables give.
TARGET = 0.85
GRID_SEED = 0


def lr_label(lr: float) -> str:
    """A learning rate as it appears in run names: ``0.01``, ``1``."""
    return f"{lr:g}"


def run_name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}-{lr_label(lr)}-s{seed}"


def arm_args(arm: str, lr: float) -> list[str]:
    """The launcher arguments that make ``arm`` with server learning rate ``lr`` (none for fedavg)."""
    if arm == "fedavg":
        if lr != 1.0:
            raise ValueError(f"fedavg has no server learning rate (it is x + Δ, η = 1); got {lr:g}")
        return []
    if arm not in OPTIONS:
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"{arm}: the server learning rate must be a number > 0, got {lr!r}")
    return ["--server-set", f'server_optimizer.name="{arm}"',
            "--server-set", f"server_optimizer.options={{lr = {lr!r}, {OPTIONS[arm]}}}"]


def config_value(section: str, key: str) -> Any:
    return tomllib.loads((ROOT / CONFIG).read_text())[section][key]


def parse_lrs(items: list[str]) -> dict[str, list[float]]:
    """``--lr ARM=LR[,LR...]`` -> {arm: [lr, ...]}; ValueError naming a bad item."""
    out: dict[str, list[float]] = {}
    for item in items:
        arm, sep, value = item.partition("=")
        if not sep or arm not in ARMS:
            raise ValueError(f"--lr {item!r}: expected ARM=LR with ARM one of {', '.join(ARMS)}")
        try:
            lrs = [float(v) for v in value.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--lr {item!r}: {value!r} is not a number (or a comma-separated list)") from None
        if not lrs:
            raise ValueError(f"--lr {item!r}: no learning rate")
        for lr in lrs:
            arm_args(arm, lr)  # checks it
        out.setdefault(arm, []).extend(lrs)
    return out


@dataclass(frozen=True)
class PlannedRun:
    """One federation of the campaign."""

    arm: str
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return run_name(self.arm, self.lr, self.seed)


def plan(arms: list[str], lrs: dict[str, list[float]], seeds: list[int]) -> list[PlannedRun]:
    """The runs in the order they start: seed by seed, arm by arm, learning rate by learning rate. An arm without
    learning rates in ``lrs`` is left out, except fedavg, which has one (η = 1)."""
    runs = []
    for seed in seeds:
        for arm in arms:
            for lr in (lrs.get(arm) or ([1.0] if arm == "fedavg" else [])):
                runs.append(PlannedRun(arm, lr, seed))
    return runs


def launch_cmd(r: PlannedRun, run_dir: Path, rounds: int, args: argparse.Namespace) -> list[str]:
    """The launcher command of one run (``--resume`` is added by :func:`tools.runs.start_run` when it resumes)."""
    return [sys.executable, "-m", "fedlaunch", "--config", CONFIG, "--run-dir", str(run_dir), "--seed", str(r.seed),
            "--insecure", "--rounds", str(rounds), "--procs", str(args.procs), "--torch-threads",
            str(args.torch_threads), "--server-set", f"rounds.sampling_timeout_s={args.sampling_timeout}",
            *arm_args(r.arm, r.lr)]


def run_spec(r: PlannedRun, rounds: int) -> dict[str, Any]:
    """What defines a run, kept in its record: a run directory is resumed only by the same spec."""
    return {"experiment": "server_opt", "arm": r.arm, "server_lr": r.lr, "seed": r.seed, "config": CONFIG,
            "rounds": rounds, "client_lr": float(config_value("training", "learning_rate")),
            "arm_args": arm_args(r.arm, r.lr)}


def chosen_lrs(args: argparse.Namespace) -> dict[str, list[float]]:
    """The learning rates ``run`` runs: ``--grid``, ``--lr`` and ``--best-of`` together."""
    lrs: dict[str, list[float]] = {}
    if args.grid:
        lrs = {a: list(GRID[a]) for a in ARMS}
    for arm, more in parse_lrs(args.lr).items():
        lrs.setdefault(arm, []).extend(lr for lr in more if lr not in lrs.get(arm, []))
    if args.best_of:
        best = best_lrs(load_runs([args.best_of]))
        if not best:
            raise ValueError(f"--best-of {args.best_of}: no seed-{GRID_SEED} runs with rounds there")
        print("best of the grid: " + ", ".join(f"{a} {lr_label(lr)}" for a, lr in best.items()), flush=True)
        for arm, lr in best.items():
            lrs.setdefault(arm, [])
            if lr not in lrs[arm]:
                lrs[arm].append(lr)
    return lrs


def run(args: argparse.Namespace) -> int:
    try:
        lrs = chosen_lrs(args)
    except ValueError as err:
        print(f"server_opt_experiment: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or int(config_value("rounds", "num_rounds"))
    jobs: list[tuple[PlannedRun, Path, list[str], dict[str, Any]]] = []
    try:  # every run directory is checked before anything starts
        for r in plan(args.arms, lrs, args.seeds):
            run_dir, spec = out / r.name, run_spec(r, rounds)
            state = run_state(run_dir, spec)
            print(f"{r.name}: {state}", flush=True)
            if state != "finished":
                jobs.append((r, run_dir, launch_cmd(r, run_dir, rounds, args), spec))
    except RunDirError as err:
        print(f"server_opt_experiment: {err}", file=sys.stderr)
        return 2
    if not jobs or args.dry_run:
        for _, _, cmd, _ in jobs:
            print(" ".join(cmd))
        return 0
    run_jobs([Job(r.name, run_dir, cmd, spec, rounds) for r, run_dir, cmd, spec in jobs], args.parallel,
             args.timeout, log=lambda line: print(line, flush=True))
    return 0


# ---- reading runs back ----

_NAME = re.compile(rf"(?:^|-)({'|'.join(sorted(ARMS, key=len, reverse=True))})-(\d[0-9.]*(?:e[+-]?\d+)?)-s(\d+)$")


@dataclass
class RunData:
    """One run as ``summarize`` sees it: a run directory, or a collected ``NAME.rounds.jsonl`` (+ record)."""

    name: str
    arm: str
    lr: float
    seed: int
    rows: list[dict[str, Any]]
    record: dict[str, Any] | None
    done: bool | None  # None: unknown (a rounds file without a record)

    def central(self) -> list[float]:
        return [float(r.get("central_accuracy", math.nan)) for r in self.rows]

    def last(self) -> float:
        c = self.central()
        return c[-1] if c else math.nan

    def last_mean(self) -> float:
        return finite_mean(self.central()[-LAST:])

    def first_at(self, target: float) -> int | None:
        """The first round whose central accuracy is at least ``target``; None when none is."""
        return next((int(r["round"]) for r in self.rows if float(r.get("central_accuracy", math.nan)) >= target),
                    None)

    def wall_s(self) -> float:
        return float(self.record.get("wall_s") or math.nan) if self.record else math.nan

    def round_s(self) -> float:
        return finite_mean([float(r.get("seconds", math.nan)) for r in self.rows])

    def reached(self) -> str:
        return f"{len(self.rows)}*" if self.done is False else str(len(self.rows))


Key = tuple[str, float, int]


def load_runs(paths: list[str]) -> dict[Key, RunData]:
    """The runs under ``paths``: campaign directories (of run directories or collected ``NAME.rounds.jsonl``
    files), run directories or ``NAME.rounds.jsonl`` files, named ``[prefix-]<arm>-<lr>-s<seed>``."""
    found: list[tuple[str, Path]] = []
    for p in map(Path, paths):
        if p.is_file() and p.name.endswith(".rounds.jsonl"):
            found.append((p.name.removesuffix(".rounds.jsonl"), p))
        elif p.is_dir() and ((p / "rounds.jsonl").exists() or (p / RECORD).exists()):
            found.append((p.name, p))
        elif p.is_dir():
            for q in sorted(p.iterdir()):
                if q.is_dir() and ((q / "rounds.jsonl").exists() or (q / RECORD).exists()):
                    found.append((q.name, q))
                elif q.is_file() and q.name.endswith(".rounds.jsonl"):
                    found.append((q.name.removesuffix(".rounds.jsonl"), q))
        else:
            raise SystemExit(f"summarize: {p} is neither a run directory, a campaign directory nor a "
                             f"NAME.rounds.jsonl file")
    runs: dict[Key, RunData] = {}
    for name, p in found:
        m = _NAME.search(name)
        if not m:
            continue
        done: bool | None
        if p.is_dir():
            record, done = read_record(p), finished(p)
        else:
            record = read_record(p.with_name(name + ".record.json"))
            done = bool(record.get("finished")) if record else None
        key = (m.group(1), float(m.group(2)), int(m.group(3)))
        if key in runs:
            raise SystemExit(f"summarize: two runs of {key}: {runs[key].name} and {name}; pass one of them")
        rows = [r for r in read_rows(p) if r.get("outcome")]
        runs[key] = RunData(name, key[0], key[1], key[2], rows, record, done)
    return runs


def best_lrs(runs: dict[Key, RunData]) -> dict[str, float]:
    """Each arm's server learning rate with the highest mean central accuracy over the last :data:`LAST` rounds
    on seed :data:`GRID_SEED` (ties: the smaller learning rate); arms without such runs are left out."""
    best: dict[str, float] = {}
    for arm in ARMS:
        cands = [(rd.last_mean(), -rd.lr) for (a, _, s), rd in runs.items()
                 if a == arm and s == GRID_SEED and rd.rows and not math.isnan(rd.last_mean())]
        if cands:
            best[arm] = -max(cands)[1]
    return best


def _first_mean(rds: list[RunData], target: float) -> str:
    """Mean over seeds of the first round at the target; with "(n/m)" when only n of the m runs reached it."""
    firsts = [rd.first_at(target) for rd in rds]
    hit = [f for f in firsts if f is not None]
    if not hit:
        return "-"
    mean = f"{sum(hit) / len(hit):.1f}"
    return mean if len(hit) == len(firsts) else f"{mean} ({len(hit)}/{len(firsts)})"


def _sd(vals: list[float]) -> str:
    kept = [v for v in vals if not math.isnan(v)]
    return fmt(statistics.stdev(kept)) if len(kept) > 1 else "-"


def render(runs: dict[Key, RunData], target: float = TARGET) -> str:
    """The Markdown the ``summarize`` command prints: grid, chosen settings per seed, runs, order."""
    best = best_lrs(runs)
    arm_order = {a: i for i, a in enumerate(ARMS)}
    lines = [f"Learning-rate grid, seed {GRID_SEED} (central accuracy; **bold**: the arm's choice, best mean of the "
             f"last {LAST} rounds):", ""]
    grid_rows = []
    for key in sorted((k for k in runs if k[2] == GRID_SEED), key=lambda k: (arm_order[k[0]], k[1])):
        rd = runs[key]
        mark = "**" if best.get(rd.arm) == rd.lr else ""
        grid_rows.append([f"{mark}{rd.arm}{mark}", f"{mark}{lr_label(rd.lr)}{mark}", rd.reached(), fmt(rd.last()),
                          f"{mark}{fmt(rd.last_mean())}{mark}", opt_text(rd.first_at(target))])
    lines += md_table(["arm", "server lr", "rounds", "last round", f"mean of last {LAST}",
                     f"first round >= {target:g}"], grid_rows)
    lines += ["", "Settings on every seed: each arm's choice (**bold**), then any other setting run on more seeds "
              "(central accuracy; mean and sd over the seeds):", ""]
    seed_rows: list[list[str]] = []
    means: dict[str, tuple[float, float]] = {}
    settings = sorted({(a, lr) for (a, lr, s) in runs if best.get(a) == lr or s != GRID_SEED},
                      key=lambda t: (arm_order[t[0]], best.get(t[0]) != t[1], t[1]))
    for arm, lr in settings:
        rds = [runs[k] for k in sorted(runs) if k[:2] == (arm, lr) and runs[k].rows]
        if not rds:
            continue
        chosen = best.get(arm) == lr
        b = "**" if chosen else ""
        for rd in rds:
            seed_rows.append([arm, lr_label(lr), str(rd.seed), rd.reached(), fmt(rd.last()), fmt(rd.last_mean()),
                              opt_text(rd.first_at(target))])
        lasts, last5 = [rd.last() for rd in rds], [rd.last_mean() for rd in rds]
        if chosen:
            means[f"{arm} (lr {lr_label(lr)})"] = (finite_mean(last5), finite_mean(lasts))
        seed_rows.append([f"{b}{arm}{b}", f"{b}{lr_label(lr)}{b}", f"{b}mean of {len(rds)}{b}", "",
                          f"{b}{fmt(finite_mean(lasts))}{b} ± {_sd(lasts)}",
                          f"{b}{fmt(finite_mean(last5))}{b} ± {_sd(last5)}", f"{b}{_first_mean(rds, target)}{b}"])
    lines += md_table(["arm", "server lr", "seed", "rounds", "last round", f"mean of last {LAST}",
                     f"first round >= {target:g}"], seed_rows)
    lines += ["", "Runs (wall time over all sittings; s/round: the server's mean round time):", ""]
    run_rows = []
    for key in sorted(runs, key=lambda k: (k[2], arm_order[k[0]], k[1])):
        rd = runs[key]
        status = {True: "finished", False: "unfinished", None: "?"}[rd.done]
        sittings = len(rd.record["sittings"]) if rd.record else 0
        run_rows.append([rd.name, rd.reached(), status, fmt(rd.wall_s() / 60.0, 1), fmt(rd.round_s(), 2),
                         str(sittings) if rd.record else "-"])
    lines += md_table(["run", "rounds", "status", "wall (min)", "s/round", "sittings"], run_rows)
    if means:
        order = sorted(means.items(), key=lambda t: -t[1][0] if not math.isnan(t[1][0]) else math.inf)
        lines += ["", f"Order of the choices by the mean over seeds of the last-{LAST} mean: "
                  + " > ".join(f"{name} {fmt(v[0])}" for name, v in order)]
    if any(rd.done is False for rd in runs.values()):
        lines += ["", "`*` unfinished run (rounds reached): its last rounds are not the end of the run."]
    return "\n".join(lines)


def summarize(args: argparse.Namespace) -> int:
    try:
        runs = load_runs(args.paths)
    except RunDirError as err:
        print(f"summarize: {err}", file=sys.stderr)
        return 2
    text = render(runs, args.target)
    print(text)
    if args.into:
        splice(Path(args.into), text, args.block)
    return 0


def collect(args: argparse.Namespace) -> int:
    """Copy the finished runs' (``--partial``: every run's) ``rounds.jsonl`` and record out of a campaign directory
    as ``NAME.rounds.jsonl`` / ``NAME.record.json`` (:func:`tools.runs.collect_runs`)."""
    collect_runs(Path(args.out), Path(args.dest), _NAME, args.partial)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="launch the campaign's federations (skipping finished, resuming unfinished)")
    r.add_argument("--out", default="runs/server_opt")
    r.add_argument("--seeds", type=int, nargs="+", default=[GRID_SEED])
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    r.add_argument("--grid", action="store_true", help="every server learning rate of the grid: "
                   + "; ".join(f"{a} {', '.join(map(lr_label, g))}" for a, g in GRID.items()))
    r.add_argument("--lr", nargs="+", default=[], metavar="ARM=LR[,LR]", help="these server learning rates")
    r.add_argument("--best-of", default="", metavar="DIR",
                   help=f"each arm's best grid setting on seed {GRID_SEED} among the runs in DIR")
    r.add_argument("--rounds", type=int, default=0, help="rounds per run (0: the config's)")
    r.add_argument("--parallel", type=int, default=2)
    r.add_argument("--procs", type=int, default=1, help="client processes per run")
    r.add_argument("--torch-threads", type=int, default=1, help="torch threads per client process")
    r.add_argument("--sampling-timeout", type=float, default=600.0, help="rounds.sampling_timeout_s")
    r.add_argument("--timeout", type=float, default=0.0,
                   help="stop a run after this many seconds of this sitting (0: never); it resumes next time")
    r.add_argument("--dry-run", action="store_true", help="print the commands of the runs to start, start none")
    s = sub.add_parser("summarize", help="the Markdown tables")
    s.add_argument("paths", nargs="+", metavar="PATH",
                   help="campaign directories, run directories or NAME.rounds.jsonl files ([prefix-]ARM-LR-sSEED)")
    s.add_argument("--target", type=float, default=TARGET, help="the accuracy whose first round is given")
    s.add_argument("--into", default="", help=f"write the tables into this Markdown file between its {BEGIN} and "
                                              f"{END} lines")
    s.add_argument("--block", default="", help="with --into: the block's name (<!-- summarize NAME: begin -->)")
    c = sub.add_parser("collect", help="copy finished runs' rounds.jsonl and record.json out for committing")
    c.add_argument("out", help="the campaign directory (run --out)")
    c.add_argument("dest", help="where NAME.rounds.jsonl and NAME.record.json go")
    c.add_argument("--partial", action="store_true", help="also the unfinished runs (marked in their record)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"run": run, "summarize": summarize, "collect": collect}
    return commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
