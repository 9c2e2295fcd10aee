"""Buffered (FedBuff) against sync rounds: time to a target central accuracy (issue 52, docs/results/buffered.md).

    python -m tools.experiments.buffered run --out runs/buffered --seeds 0 1 2 --parallel 2
    python -m tools.experiments.buffered nfl --out runs/buffered --rounds 60
    python -m tools.experiments.buffered report runs/buffered [runs/buffered_long] --target 0.85 --window 5
    python -m tools.experiments.buffered run --out runs/heldout --seeds 3 4 --tag lr2 \
        --buffered-set server_optimizer.name='"fedavgm"' \
        --buffered-set server_optimizer.options='{lr = 2.0, momentum = 0.0}'
    python -m tools.experiments.buffered report runs/heldout --seeds 3 4 --tag lr2

``run`` launches, per seed, a sync and a buffered federation of ``configs/mnist_stragglers.toml`` (``fedguard-launch``:
a real fedserver and 100 virtual fedclients over loopback; every device a lognormal straggler, sigma = 1, and a 10%
dropout per task), each in ``OUT/<mode>-s<seed>/``, ``--parallel`` at a time; the campaign machinery is
:mod:`tools.runs` (records, resume, skip the finished). Sync selects K = 10 devices a round and waits for them (or the
deadline); buffered keeps C = 20 devices training and forms a round of every M = 10 updates that arrive. A variant of
the buffered arm (``--buffered-set SECTION.KEY=VALUE``, repeatable: a server learning rate, another concurrency) runs
as ``OUT/buffered-<tag>-s<seed>/`` under ``--tag``, and ``report --tag`` compares it with sync.

``nfl`` runs the NFL environment (``configs/mnist_nfl.toml``: 30% label-flipping attackers) in buffered mode with
detect-and-recover, in ``OUT/nfl-buffered-s<seed>/``.

``report`` reads the campaign directories and prints, per seed and mode: the rounds run, the wall seconds (from round
1's start: the clients' start-up is not counted) and the client updates (accepted updates) until the central accuracy
(mean of the last ``--window`` rounds) first reached ``--target``, the final accuracy (mean of the last 5 rounds; for
buffered also after as many updates as the sync run had) and the speed-up; for an NFL run, when NFL was reported and
the benign beta before and after the report.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any

from tools.runs import Job, fmt, md_table, read_rows, run_jobs

CONFIG = "configs/mnist_stragglers.toml"
NFL_CONFIG = "configs/mnist_nfl.toml"
MODES: dict[str, list[str]] = {
    "sync": ["--server-set", "rounds.mode='sync'"],
    "buffered": ["--server-set", "rounds.mode='buffered'", "--server-set", "rounds.concurrency=20"],
}
# The device behaviour of every run (issue 52): lognormal stragglers, sigma = 1, median 1 s; 10% dropout per task.
DEVICES = ["--straggler", "lognormal", "--straggler-delay", "1.0", "--straggler-sigma", "1.0", "--stragglers", "1.0",
           "--dropout", "0.1", "--dropout-return", "10"]
LAST = 5


def launch_cmd(config: str, run_dir: Path, seed: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "fedlaunch", "--config", config, "--run-dir", str(run_dir), "--seed", str(seed),
            "--insecure", *DEVICES, *extra]


def run_name(mode: str, seed: int, tag: str = "") -> str:
    """``<mode>-s<seed>``; a tagged buffered variant ``buffered-<tag>-s<seed>`` (sync runs are never tagged)."""
    return f"{mode}-{tag}-s{seed}" if tag and mode == "buffered" else f"{mode}-s{seed}"


def jobs(args: argparse.Namespace) -> list[Job]:
    out = Path(args.out)
    tag, settings = getattr(args, "tag", ""), list(getattr(args, "buffered_set", None) or [])
    if settings and not tag:
        raise SystemExit("run: --buffered-set needs a --tag (the variant's runs are named buffered-<tag>-s<seed>)")
    if tag and not re.fullmatch(r"[a-z0-9]+", tag):
        raise SystemExit(f"run: --tag must be lower-case letters and digits, got {tag!r}")
    plan = []
    for seed in args.seeds:
        for mode in args.modes:
            variant = settings if mode == "buffered" else []
            extra = [*MODES[mode], *(x for item in variant for x in ("--server-set", item)), "--rounds",
                     str(args.rounds)]
            run_dir = out / run_name(mode, seed, tag)
            spec = {"experiment": "buffered", "mode": mode, "seed": seed, "config": CONFIG, "rounds": args.rounds,
                    "devices": DEVICES}
            if variant:  # only then: the untagged runs' records stay what they were (they resume)
                spec["buffered_set"] = variant
            plan.append(Job(run_dir.name, run_dir, launch_cmd(CONFIG, run_dir, seed, extra), spec, args.rounds))
    return plan


def nfl_jobs(args: argparse.Namespace) -> list[Job]:
    out = Path(args.out)
    plan = []
    for seed in args.seeds:
        run_dir = out / f"nfl-buffered-s{seed}"
        extra = [*MODES["buffered"], "--nfl-mode", "detect-and-recover", "--rounds", str(args.rounds),
                 "--server-set", f"nfl.nr={args.nr}", "--server-set", f"nfl.c={args.c}",
                 "--private-epochs", str(args.private_epochs), "--server-set", "rounds.round_timeout_s=15.0",
                 "--server-set", "rounds.sampling_timeout_s=900.0"]
        spec = {"experiment": "buffered-nfl", "seed": seed, "config": NFL_CONFIG, "rounds": args.rounds,
                "nr": args.nr, "c": args.c, "private_epochs": args.private_epochs, "devices": DEVICES}
        plan.append(Job(run_dir.name, run_dir, launch_cmd(NFL_CONFIG, run_dir, seed, extra), spec, args.rounds))
    return plan


def time_to_target(rows: list[dict[str, Any]], target: float, window: int = 1) -> tuple[float, int, int] | None:
    """(wall seconds from round 1's start, client updates, round) when the central accuracy -- the mean of the
    last ``window`` rounds' (1: the round's own) -- first reached ``target``; None when it never did."""
    if not rows:
        return None
    t0 = float(rows[0]["wall_seconds"]) - float(rows[0]["seconds"])
    updates = 0
    accs: list[float] = []
    for r in rows:
        updates += int(r["accepted"])
        accs.append(float(r["central_accuracy"]))
        recent = accs[-window:]
        if len(recent) == window and not any(math.isnan(a) for a in recent) and math.fsum(recent) / window >= target:
            return float(r["wall_seconds"]) - t0, updates, int(r["round"])
    return None


def final_accuracy(rows: list[dict[str, Any]], upto: int = 0) -> float:
    """The mean central accuracy of the last :data:`LAST` rounds (of the first ``upto`` rounds when given)."""
    rows = rows[:upto] if upto else rows
    tail = [float(r["central_accuracy"]) for r in rows[-LAST:]]
    return math.fsum(tail) / len(tail) if tail else math.nan


def longest(dirs: list[Path], name: str) -> list[dict[str, Any]]:
    """The rows of the run ``name`` with the most rounds among ``dirs``: campaign directories (``d/name/``) or
    directories of collected rows (``d/name-*.rounds.jsonl``, as docs/results/buffered/ keeps them)."""
    paths = [p for d in dirs for p in (d / name, *sorted(d.glob(f"{name}-*.rounds.jsonl")))]
    return max((read_rows(p) for p in paths), key=len, default=[])


def report(args: argparse.Namespace) -> int:
    dirs = [Path(d) for d in args.out]
    window = args.window
    lines = [f"Target: central accuracy {'' if window == 1 else f'(mean of the last {window} rounds) '}>= "
             f"{args.target:.2f}; wall seconds from round 1's start; final accuracy = mean of the last {LAST} "
             "rounds of the run (and, for buffered, after as many updates as the sync run had).", ""]
    head = ["seed", "mode", "rounds", "wall to target (s)", "updates to target", "round", "final acc",
            "acc at sync's updates", "total wall (s)", "speed-up"]
    table = []
    for seed in args.seeds:
        got: dict[str, tuple[float, int, int] | None] = {}
        sync_rounds = 0
        for mode in MODES:
            rows = longest(dirs, run_name(mode, seed, args.tag))
            if not rows:
                continue
            hit = time_to_target(rows, args.target, window)
            got[mode] = hit
            t0 = float(rows[0]["wall_seconds"]) - float(rows[0]["seconds"])
            speed, equal = "", ""
            if mode == "sync":
                sync_rounds = len(rows)
            elif sync_rounds:
                equal = fmt(final_accuracy(rows, sync_rounds), 4)
                sync_hit = got.get("sync")
                if hit is not None and sync_hit is not None:
                    speed = f"{sync_hit[0] / hit[0]:.2f}x"
            table.append([str(seed), mode, str(len(rows)), "-" if hit is None else f"{hit[0]:.1f}",
                          "-" if hit is None else str(hit[1]), "-" if hit is None else str(hit[2]),
                          fmt(final_accuracy(rows), 4), equal, f"{float(rows[-1]['wall_seconds']) - t0:.1f}",
                          speed])
    lines += md_table(head, table)
    for seed in args.seeds:
        rows = longest(dirs, f"nfl-buffered-s{seed}")
        if rows:
            lines += ["", *nfl_lines(rows, seed)]
    text = "\n".join(lines)
    print(text)
    return 0


def nfl_lines(rows: list[dict[str, Any]], seed: int) -> list[str]:
    reported = next((int(r["round"]) for r in rows if r["nfl"] == "reported"), None)
    before = [float(r["beta_benign"]) for r in rows if reported is None or int(r["round"]) <= reported]
    after = [float(r["beta_benign"]) for r in rows if reported is not None and int(r["round"]) > reported]

    def mean(v: list[float]) -> float:
        v = [x for x in v if not math.isnan(x)]
        return math.fsum(v) / len(v) if v else math.nan

    last = [float(r["beta_benign"]) for r in rows[-10:]]
    return [f"NFL environment, buffered, seed {seed}: {len(rows)} rounds; NFL reported at round "
            f"{reported if reported is not None else '- (never)'}; benign beta before the report "
            f"{fmt(mean(before))}, after it {fmt(mean(after))}, last 10 rounds {fmt(mean(last))}; staleness mean "
            f"{fmt(mean([float(r['staleness_mean']) for r in rows]), 2)}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.experiments.buffered", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the sync and buffered runs")
    r.add_argument("--out", default="runs/buffered")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    r.add_argument("--rounds", type=int, default=40)
    r.add_argument("--parallel", type=int, default=2)
    r.add_argument("--timeout", type=float, default=0.0, help="stop a run after this many seconds (resumable)")
    r.add_argument("--tag", default="", help="name of a variant of the buffered arm (runs buffered-<tag>-s<seed>)")
    r.add_argument("--buffered-set", action="append", metavar="SECTION.KEY=VALUE",
                   help="a server setting of the buffered runs only (repeatable; needs --tag)")
    n = sub.add_parser("nfl", help="the NFL environment in buffered mode")
    n.add_argument("--out", default="runs/buffered")
    n.add_argument("--seeds", type=int, nargs="+", default=[0])
    n.add_argument("--rounds", type=int, default=60)
    n.add_argument("--nr", type=int, default=10)
    n.add_argument("--c", type=int, default=10)
    n.add_argument("--private-epochs", type=int, default=5)
    n.add_argument("--parallel", type=int, default=1)
    n.add_argument("--timeout", type=float, default=0.0)
    s = sub.add_parser("report", help="the time-to-accuracy table")
    s.add_argument("out", nargs="+", help="campaign directories (per run, the one with the most rounds is read)")
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    s.add_argument("--target", type=float, default=0.85)
    s.add_argument("--window", type=int, default=5, help="rounds averaged before the target is compared")
    s.add_argument("--tag", default="", help="compare the buffered variant of this tag with sync")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run_jobs(jobs(args), args.parallel, args.timeout)
        return 0
    if args.cmd == "nfl":
        run_jobs(nfl_jobs(args), args.parallel, args.timeout)
        return 0
    return report(args)


if __name__ == "__main__":
    sys.exit(main())
