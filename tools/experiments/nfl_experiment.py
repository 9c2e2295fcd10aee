"""FL-GUARD acceptance experiment: FedAvg vs detect-and-recover vs always-recover vs 50% holdouts, NFL vs ideal.

    python tools/experiments/nfl_experiment.py run --out runs/nfl_exp --seeds 0 1 2 --parallel 2 \\
        [--until 2026-11-25T05:25]
    python tools/experiments/nfl_experiment.py collect runs/nfl_exp docs/results/nfl_paper
    python tools/experiments/nfl_experiment.py summarize docs/results/nfl_paper --runs --into docs/results/nfl_paper.md

``run`` launches every (environment, arm, seed) as its own federation (``fedguard-launch --config
configs/mnist_{nfl,ideal}.toml``, real fedserver and virtual fedclient processes over loopback), ``--parallel`` at a
time, each in ``OUT/<env>-<arm>-s<seed>/``, row by row ((env, arm) with all its seeds). Arms: ``fedavg``
(nfl.mode = off), ``detect`` (detect-and-recover), ``always`` (always-recover), ``holdouts`` (detect-and-recover,
50% of the benign clients opt out); for the recovery methods side by side also ``fedprox`` and ``lindt``,
``ditto``, ``apfl``, ``ft``, ``fb`` (detect-and-recover with that ``[recovery] method``). Rounds, NR, c and the
private epochs are the configs' (150, 20, 20, 20) unless given.

A campaign survives stops (:mod:`tools.runs`): each run keeps a record (``record.json`` beside its
``rounds.jsonl``: its settings, seed, and every sitting's command, package versions, fedguard commit, wall time
and rounds); running the same command again skips finished runs and resumes unfinished ones from their last
completed round (``fedlaunch --resume``); a run directory without this runner's record, or with a record of
other settings, stops it before anything starts. ``--timeout`` stops a run after that long in one sitting,
``--until`` stops everything at a time and starts no run that would not finish before it.

``collect`` copies finished runs' ``rounds.jsonl`` and record out as ``NAME.rounds.jsonl`` / ``NAME.record.json``
for committing. ``summarize`` reads run directories, campaign directories or such files (names
``[prefix-]<env>-<arm>-s<seed>``) and prints one row per (environment, arm, client group), means over seeds of the
last 10 rounds each run reached (an unfinished run marked ``*``):
- ``acc``: benign local accuracy of the model each client infers with (vᵢ while/after adapting, else w^{r-1});
- ``beta``: benign β = mean(Vᵢ − Pᵢ) on the clients' full test splits (FL-GUARD Eq. 1–2, αᵢ = 1/N);
- ``abs(beta_hat - beta)``: mean |β̂ᵢ − βᵢ| (how well the first-batch β̂ᵢ tracks βᵢ);
- ``detect`` / ``cancel``: the first round with NFL reported, the first round with the report cancelled;
- ``compute``: the clients' training seconds per round (whole run) relative to the same seed's FedAvg run;
- ``passes``: forward/backward passes per round relative to vanilla training (whole run);
and with ``--runs`` a row per run: rounds, finished or not, wall time over its sittings, where it was resumed,
the code it ran.
"""

from __future__ import annotations

import argparse
import itertools
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

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

# The environments' configs per dataset (--dataset): the papers' NFL and ideal environments (SPEC §11).
DATASETS = {d: {"nfl": f"configs/{d}_nfl.toml", "ideal": f"configs/{d}_ideal.toml"} for d in ("mnist", "cifar10")}
ENVS = DATASETS["mnist"]
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
# The tables are means of the last LAST rounds each run reached (the papers' convention).
LAST = 10


def _launch_cmd(env: str, arm: str, seed: int, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The launcher command of one run (``--resume`` is added by :func:`tools.runs.start_run` when it resumes)."""
    rounds, nr, c, private_epochs = _resolved(env, args)
    cmd = [sys.executable, "-m", "fedlaunch", "--config", config_path(env, args), "--run-dir", str(run_dir), "--seed",
           str(seed), "--procs", str(args.procs), *ALL_ARMS[arm], "--server-set", f"nfl.nr={nr}",
           "--server-set", f"nfl.c={c}",
           # round 1 waits for all N clients, which first train their private models: give them time
           "--server-set", f"rounds.sampling_timeout_s={args.sampling_timeout}",
           "--rounds", str(rounds), "--private-epochs", str(private_epochs)]
    if args.device:
        cmd += ["--device", args.device]
    if getattr(args, "detector", ""):
        cmd += ["--server-set", f"nfl.detector='{args.detector}'"]
    if getattr(args, "torch_threads", None):
        cmd += ["--torch-threads", str(args.torch_threads)]
    return cmd


def config_path(env: str, args: argparse.Namespace) -> str:
    """The environment's config file for the run's dataset (``configs/<dataset>_<env>.toml``)."""
    return DATASETS[getattr(args, "dataset", "mnist")][env]


def config_value(env: str, section: str, key: str, args: argparse.Namespace | None = None) -> Any:
    """A value of the environment's config file (``configs/<dataset>_<env>.toml``, MNIST's without ``args``)."""
    import tomllib

    path = config_path(env, args) if args is not None else ENVS[env]
    return tomllib.loads((ROOT / path).read_text())[section][key]


def _resolved(env: str, args: argparse.Namespace) -> tuple[int, int, int, int]:
    """(rounds, nr, c, private epochs) of a run: the arguments, else the config's."""
    return (args.rounds or int(config_value(env, "rounds", "num_rounds", args)),
            args.nr if args.nr is not None else int(config_value(env, "nfl", "nr", args)),
            args.c if args.c is not None else int(config_value(env, "nfl", "c", args)),
            args.private_epochs if args.private_epochs is not None
            else int(config_value(env, "launch", "private_epochs", args)))


def run_spec(env: str, arm: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """What defines a run, kept in its record: a run directory is resumed only by the same spec."""
    rounds, nr, c, private_epochs = _resolved(env, args)
    spec = {"experiment": "nfl", "env": env, "arm": arm, "seed": seed, "config": config_path(env, args),
            "rounds": rounds, "nr": nr, "c": c, "private_epochs": private_epochs, "arm_args": ALL_ARMS[arm]}
    if getattr(args, "detector", ""):  # named only when given, so that earlier campaigns' records still match
        spec["detector"] = args.detector
    return spec


def plan(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """The runs in the order they start: row by row, (env, arm) with all its seeds, so whole table rows
    complete early (and the FedAvg runs, every arm's compute reference, come first)."""
    return [(e, a, s) for e in args.envs for a in args.arms for s in args.seeds]


def _parse_until(text: str) -> float:
    """``--until``: an ISO time (UTC unless it says otherwise) -> epoch seconds; 0 for none."""
    if not text:
        return 0.0
    import datetime as dt

    t = dt.datetime.fromisoformat(text)
    return (t if t.tzinfo else t.replace(tzinfo=dt.UTC)).timestamp()


def _estimate(out: Path, env: str, arm: str) -> float:
    """Wall seconds a run of (env, arm) takes: the longest finished sibling done in one sitting; 0 when none."""
    walls = []
    for d in out.glob(f"{env}-{arm}-s*"):
        try:
            rec = read_record(d)
        except RunDirError:
            continue
        if rec and rec.get("finished") and not any(s.get("resumed") for s in rec["sittings"]):
            walls.append(float(rec.get("wall_s") or 0.0))
    return max(walls, default=0.0)


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    until = _parse_until(args.until)
    # Every run directory is checked before anything starts: one the runner must not touch stops it here.
    jobs: list[tuple[str, Path, list[str], dict[str, Any]]] = []
    try:
        for e, a, s in plan(args):
            name, run_dir = f"{e}-{a}-s{s}", out / f"{e}-{a}-s{s}"
            spec = run_spec(e, a, s, args)
            state = run_state(run_dir, spec)
            if state == "finished":
                print(f"{name}: already finished", flush=True)
                continue
            print(f"{name}: {state}", flush=True)
            jobs.append((name, run_dir, _launch_cmd(e, a, s, args, run_dir), spec))
    except RunDirError as err:
        print(f"nfl_experiment: {err}", file=sys.stderr)
        return 2
    if not jobs:
        return 0
    run_jobs([Job(name, run_dir, cmd, spec, int(spec["rounds"])) for name, run_dir, cmd, spec in jobs],
             args.parallel, args.timeout, until, lambda job: _estimate(out, job.spec["env"], job.spec["arm"]),
             log=lambda line: print(line, flush=True))
    return 0


def _tail(rows: list[dict[str, Any]], key: str, last: int = LAST) -> float:
    return finite_mean([r.get(key, math.nan) for r in rows[-last:]])


def _first(rows: list[dict[str, Any]], pred: Any) -> int | None:
    return next((int(r["round"]) for r in rows if pred(r)), None)


def _cancel_round(rows: list[dict[str, Any]]) -> int | None:
    for prev, r in itertools.pairwise(rows):
        if prev.get("nfl") == "reported" and r.get("nfl") == "watching":
            return int(r["round"])
    return None


@dataclass
class RunData:
    """One run as ``summarize`` sees it: a run directory, or a collected ``NAME.rounds.jsonl`` (+ record)."""

    name: str
    env: str
    arm: str
    seed: int
    rows: list[dict[str, Any]]
    record: dict[str, Any] | None
    done: bool | None  # None: unknown (no record and no run directory)

    @property
    def target(self) -> int | None:
        return int(self.record["target_rounds"]) if self.record and self.record.get("target_rounds") else None

    def reached(self) -> str:
        """Rounds reached; an unfinished run's with a "*"."""
        if self.done is False:
            return f"{len(self.rows)}*"
        return str(len(self.rows))

    def wall_s(self) -> float:
        return float(self.record.get("wall_s") or math.nan) if self.record else math.nan


_NAME = re.compile(rf"(?:^|-)({'|'.join(ENVS)})-({'|'.join(ALL_ARMS)})-s(\d+)$")


def load_runs(paths: list[str]) -> dict[tuple[str, str, int], RunData]:
    """The runs under ``paths``: each a campaign directory (of run directories or of collected
    ``NAME.rounds.jsonl`` files), one run directory, or one ``NAME.rounds.jsonl`` file. A name is
    ``[prefix-]<env>-<arm>-s<seed>``; two runs of the same (env, arm, seed) are refused."""
    found: list[tuple[str, Path]] = []  # (name, run dir or rounds file)
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
    runs: dict[tuple[str, str, int], RunData] = {}
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
        key = (m.group(1), m.group(2), int(m.group(3)))
        if key in runs:
            raise SystemExit(f"summarize: two runs of {key}: {runs[key].name} and {name}; pass one of them")
        runs[key] = RunData(name, *key, read_rows(p), record, done)
    return runs


def summary_rows(runs: dict[tuple[str, str, int], RunData]) -> list[list[str]]:
    """One row per (env, arm, client group): means over seeds of the last :data:`LAST` rounds each run reached."""
    out = []
    for env in ENVS:
        for arm in ALL_ARMS:
            groups = [("adapting", "test_accuracy_adapting", "beta_adapting"),
                      ("holdouts", "test_accuracy_holdout", "beta_holdout")] if arm == "holdouts" else [
                ("benign", "test_accuracy_benign", "beta_benign")]
            mine = [runs[k] for k in sorted(runs) if k[:2] == (env, arm) and runs[k].rows]
            if not mine:
                continue
            for group, acc_key, beta_key in groups:
                accs, betas, errs, comp, central, passes = [], [], [], [], [], []
                for rd in mine:
                    rows = rd.rows
                    accs.append(_tail(rows, acc_key))
                    central.append(_tail(rows, "central_accuracy"))
                    passes.append(finite_mean([r.get("client_passes", math.nan) for r in rows]))
                    betas.append(_tail(rows, beta_key))
                    errs.append(_tail(rows, "beta_hat_error"))
                    ref = runs.get((env, "fedavg", rd.seed))
                    theirs = finite_mean([r.get("client_seconds", math.nan) for r in ref.rows]) if ref else math.nan
                    ours = finite_mean([r.get("client_seconds", math.nan) for r in rows])
                    comp.append(ours / theirs if theirs and not math.isnan(theirs) else math.nan)
                out.append([
                    env, arm, group, "/".join(str(rd.seed) for rd in mine), "/".join(rd.reached() for rd in mine),
                    fmt(finite_mean(central)), fmt(finite_mean(accs)), fmt(finite_mean(betas)),
                    fmt(finite_mean(errs)),
                    "/".join(opt_text(_first(rd.rows, lambda r: r.get("nfl") == "reported")) for rd in mine),
                    "/".join(opt_text(_cancel_round(rd.rows)) for rd in mine),
                    _ratio(finite_mean(comp)), _ratio(finite_mean(passes))])
    return out


def _ratio(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2f}x"


SUMMARY_HEAD = ["env", "arm", "clients", "seeds", "rounds", "central acc", "acc", "beta",
                f"abs(beta_hat - beta), last {LAST}", "detect round", "cancel round", "compute vs FedAvg",
                "passes vs vanilla"]
RUNS_HEAD = ["run", "rounds", "status", "wall (min)", "sittings", "resumed after round", "device",
             "code (fedguard commit)"]


def sitting_device(sitting: dict[str, Any]) -> str:
    """Where a sitting trained: its launcher command's ``--device`` (``cpu`` when it gives none)."""
    cmd = [str(c) for c in sitting.get("command") or []]
    return cmd[cmd.index("--device") + 1] if "--device" in cmd[:-1] else "cpu"


def per_run_rows(runs: dict[tuple[str, str, int], RunData]) -> list[list[str]]:
    """One row per run: rounds reached, finished or not, wall time over all its sittings, the code it ran."""
    out = []
    for k in sorted(runs, key=lambda k: (list(ENVS).index(k[0]), list(ALL_ARMS).index(k[1]), k[2])):
        rd = runs[k]
        sittings = rd.record["sittings"] if rd.record else []
        commits = sorted({str(s.get("fedguard_commit", ""))[:10] + ("+dirty" if s.get("fedguard_dirty") else "")
                          for s in sittings})
        status = {True: "finished", False: "unfinished", None: "?"}[rd.done]
        # A sitting that resumed after completed rounds: the server went on from its snapshot, the clients'
        # private models were trained again (same seed) and their in-memory adaptation state started over.
        resumed = [str(s.get("rounds_before")) for s in sittings if s.get("resumed") and s.get("rounds_before")]
        devices = sorted({sitting_device(s) for s in sittings})
        out.append([rd.name, f"{len(rd.rows)}/{rd.target or '?'}", status, fmt(rd.wall_s() / 60.0, 1),
                    str(len(sittings)) if rd.record else "-", ", ".join(resumed) or "-", ", ".join(devices) or "-",
                    ", ".join(commits) or "-"])
    return out


def summarize(args: argparse.Namespace) -> int:
    try:
        runs = load_runs(args.paths)
    except RunDirError as err:
        print(f"summarize: {err}", file=sys.stderr)
        return 2
    lines = md_table(SUMMARY_HEAD, summary_rows(runs))
    if any(rd.done is False for rd in runs.values()):
        asked = sorted({str(rd.target or "?") for rd in runs.values() if rd.done is False})
        lines.append(f"\n`*` unfinished run (rounds reached, of {'/'.join(asked)} asked): its last {LAST} rounds are "
                     "not the end of the run.")
    if args.runs:
        lines += ["", *md_table(RUNS_HEAD, per_run_rows(runs))]
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.into:
        splice(Path(args.into), text, args.block)
    if args.plot:
        _plot({rd.name: rd.rows for rd in runs.values()}, Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


BEGIN, END = "<!-- summarize: begin -->", "<!-- summarize: end -->"


def splice(md: Path, text: str, block: str = "") -> None:
    """Replace what lies between the ``BEGIN`` and ``END`` marker lines of ``md`` (``<!-- summarize BLOCK:
    begin -->`` ... with a block name) with ``text``; the rest of the document, written by hand, stays."""
    begin, end = (BEGIN, END) if not block else (BEGIN.replace("summarize", f"summarize {block}"),
                                                 END.replace("summarize", f"summarize {block}"))
    doc = md.read_text()
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise SystemExit(f"summarize --into: {md} needs one {begin} line and one {end} line after it")
    head, rest = doc.split(begin, 1)
    md.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def collect(args: argparse.Namespace) -> int:
    """Copy the finished runs' (``--partial``: every run's) ``rounds.jsonl`` and record out of a campaign directory
    as ``NAME.rounds.jsonl`` / ``NAME.record.json`` for committing (:func:`tools.runs.collect_runs`)."""
    collect_runs(Path(args.out), Path(args.dest), _NAME, args.partial)
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
    r.add_argument("--dataset", default="mnist", choices=list(DATASETS),
                   help="the environments' configs: configs/<dataset>_{nfl,ideal}.toml")
    r.add_argument("--envs", nargs="+", default=list(ENVS), choices=list(ENVS))
    r.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ALL_ARMS),
                   help="default: the FL-GUARD arms; the methods comparison adds fedprox lindt ditto apfl ft fb")
    r.add_argument("--parallel", type=int, default=2)
    r.add_argument("--procs", type=int, default=1, help="client processes per run")
    r.add_argument("--rounds", type=int, default=0, help="0: the config's (150)")
    r.add_argument("--private-epochs", type=int, default=None, help="default: the config's (20)")
    r.add_argument("--nr", type=int, default=None, help="nfl.nr (default: the config's, 20)")
    r.add_argument("--c", type=int, default=None, help="nfl.c (default: the config's, 20)")
    r.add_argument("--timeout", type=float, default=0.0,
                   help="stop a run after this many seconds of this sitting (0: never); it resumes next time")
    r.add_argument("--until", default="",
                   help="ISO time (UTC unless it says otherwise), e.g. 2026-11-25T05:20: start no run that the "
                        "longest finished run of its (env, arm) says would pass it, and stop (resumably) what "
                        "still runs then")
    r.add_argument("--device", default="")
    r.add_argument("--detector", default="",
                   help="nfl.detector (default: the server's, beta_hat_plateau; beta_hat: the paper's rule, which "
                        "every committed campaign before 2026-11-25 ran with)")
    r.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads of each client process (default: the launcher's); 1 on a shared machine")
    r.add_argument("--sampling-timeout", type=float, default=3600.0,
                   help="rounds.sampling_timeout_s: how long round 1 waits for the fleet (private models first)")
    s = sub.add_parser("summarize")
    s.add_argument("paths", nargs="+", metavar="PATH",
                   help="campaign directories (of run directories or collected NAME.rounds.jsonl files), run "
                        "directories or NAME.rounds.jsonl files; a name is [prefix-]<env>-<arm>-s<seed>")
    s.add_argument("--md", default="", help="write the tables to this Markdown file")
    s.add_argument("--into", default="", help=f"write the tables into this Markdown file between its {BEGIN} "
                                              f"and {END} lines")
    s.add_argument("--block", default="", help="with --into: the block's name, between <!-- summarize NAME: "
                                                "begin --> and <!-- summarize NAME: end --> (several per file)")
    s.add_argument("--runs", action="store_true", help="also a table per run: rounds, status, wall time, code")
    s.add_argument("--plot", default="", help="write a PNG of accuracy and beta per round (needs matplotlib)")
    c = sub.add_parser("collect", help="copy finished runs' rounds.jsonl and record.json out for committing")
    c.add_argument("out", help="the campaign directory (run --out)")
    c.add_argument("dest", help="where NAME.rounds.jsonl and NAME.record.json go (e.g. docs/results/nfl_paper)")
    c.add_argument("--partial", action="store_true", help="also the unfinished runs (marked in their record)")
    args = ap.parse_args(argv)
    return {"run": run, "summarize": summarize, "collect": collect}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
