"""The demo's story over seeds: ``tools/demo.sh`` with NFL detection and recovery on and with ``--nfl-mode off``.

    python tools/experiments/demo_story.py [--seeds 1 2 3 4 5] [--out runs/demo_story] [-- EXTRA LAUNCHER ARGS]

Runs the demo's federation (the launcher arguments of ``tools/demo.sh``, read from that file, so the table
measures what the demo runs) once per seed and mode, one run at a time, each in ``OUT/<mode>-s<seed>/``, and
prints a Markdown table: per seed, the adapting clients' β over the last 10 rounds (the mean of ``rounds.jsonl``'s
``beta_adapting``: β = mean(Vᵢ − Pᵢ) over the round's clients that are neither attackers nor opt-out holdouts,
FL-GUARD Eq. 1–2 with αᵢ = 1/N; in the demo that is every client, and with ``--nfl-mode off`` none of them ever
adapts), the round NFL was reported and the first round with adapting clients, for ``on`` (the demo as it is,
detect-and-recover) and ``off``; then whether the demo's targets hold: β > 0 on every seed with recovery on,
β ≥ +0.02 on their mean, β < 0 on every seed with ``--nfl-mode off``.

Runs are resumable (:mod:`tools.runs`): running the same command again skips finished runs and resumes
unfinished ones from their last completed round; a run directory this runner did not write stops it. Arguments
after ``--`` go to every launcher command (e.g. ``-- --torch-threads 1``) and are part of each run's record.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.runs import finished, finite_mean, launch_run, read_record, read_rows, split_passthrough  # noqa: E402

DEMO = ROOT / "tools" / "demo.sh"
MODES = {"on": [], "off": ["--nfl-mode", "off"]}
LAST = 10
ON_EACH_ABOVE = 0.0  # recovery on: beta > 0 on every seed
ON_MEAN_AT_LEAST = 0.02  # recovery on: mean beta >= +0.02
OFF_EACH_BELOW = 0.0  # --nfl-mode off: beta < 0 on every seed


def demo_args(script: Path = DEMO) -> list[str]:
    """The launcher arguments of the demo script's ``fedlaunch`` command (continuation lines joined), without
    its ``--run-dir`` and the script's own ``"$@"``."""
    text = script.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if "fedlaunch" in words:
            args = words[words.index("fedlaunch") + 1:]
            break
    else:
        raise ValueError(f"{script}: no 'fedlaunch' command")
    args = [a for a in args if a != "$@"]
    if "--run-dir" in args:
        i = args.index("--run-dir")
        del args[i:i + 2]
    return args


@dataclass(frozen=True)
class RunFigures:
    """One run's figures from its ``rounds.jsonl``."""

    rounds: int
    beta_last: float  # mean beta_adapting over the last LAST rounds
    acc_last: float  # mean test_accuracy_adapting over the last LAST rounds
    reported: int | None  # first round whose nfl state is "reported"
    first_adapting: int | None  # first round with adapting clients


def figures(rows: list[dict[str, Any]], last: int = LAST) -> RunFigures:
    tail = rows[-last:]
    reported = next((int(r["round"]) for r in rows if r.get("nfl") == "reported"), None)
    adapting = next((int(r["round"]) for r in rows if int(r.get("adapting", 0)) > 0), None)
    return RunFigures(len(rows), finite_mean([r.get("beta_adapting", float("nan")) for r in tail]),
                      finite_mean([r.get("test_accuracy_adapting", float("nan")) for r in tail]),
                      reported, adapting)


def _cell(v: float) -> str:
    return "-" if v != v else f"{v:+.3f}"


def _round(r: int | None) -> str:
    return "-" if r is None else str(r)


def verdict(on: list[float], off: list[float]) -> list[tuple[str, bool, str]]:
    """(target, holds, the figures it was judged on) for each of the demo's three targets."""
    mean_on = finite_mean(on)
    return [
        (f"recovery on: beta > {ON_EACH_ABOVE:+.2f} on every seed", len(on) > 0 and all(b > ON_EACH_ABOVE for b in on),
         f"min {_cell(min(on)) if on else '-'}"),
        (f"recovery on: mean beta >= {ON_MEAN_AT_LEAST:+.2f}", mean_on == mean_on and mean_on >= ON_MEAN_AT_LEAST,
         f"mean {_cell(mean_on)}"),
        (f"--nfl-mode off: beta < {OFF_EACH_BELOW:+.2f} on every seed",
         len(off) > 0 and all(b < OFF_EACH_BELOW for b in off), f"max {_cell(max(off)) if off else '-'}"),
    ]


def table(out: Path, seeds: list[int]) -> tuple[str, bool]:
    """The Markdown table of the runs under ``out`` and whether every target holds (all runs finished)."""
    lines = ["| seed | β on (last 10) | β off (last 10) | acc on | acc off | NFL reported | adapting from | "
             "wall on, off (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    on_b: list[float] = []
    off_b: list[float] = []
    complete = True
    for seed in seeds:
        figs: dict[str, RunFigures] = {}
        walls: list[str] = []
        for mode in MODES:
            run_dir = out / f"{mode}-s{seed}"
            figs[mode] = figures(read_rows(run_dir))
            complete = complete and finished(run_dir)
            record = read_record(run_dir) if run_dir.is_dir() else None
            walls.append(f"{record['wall_s']:.0f}" if record and record.get("wall_s") else "-")
        on, off = figs["on"], figs["off"]
        on_b.append(on.beta_last)
        off_b.append(off.beta_last)
        lines.append(f"| {seed} | {_cell(on.beta_last)} | {_cell(off.beta_last)} | {on.acc_last:.3f} | "
                     f"{off.acc_last:.3f} | {_round(on.reported)} | {_round(on.first_adapting)} | "
                     f"{', '.join(walls)} |")
    lines.append(f"| mean | {_cell(finite_mean(on_b))} | {_cell(finite_mean(off_b))} | | | | | |")
    checks = verdict([b for b in on_b if b == b], [b for b in off_b if b == b])
    lines.append("")
    for target, holds, why in checks:
        lines.append(f"- {target}: {'holds' if holds else 'does not hold'} ({why})")
    if not complete:
        lines.append("- not every run has finished: run the same command again to finish them")
    return "\n".join(lines), complete and all(h for _, h, _ in checks)


def recorded_command(run_dir: Path) -> str:
    """The launcher command of the run's first sitting as its record has it (``python -m fedguard.launch ...``),
    "-" when there is no record: what the table's runs ran, whatever ``tools/demo.sh`` says now."""
    record = read_record(run_dir) if run_dir.is_dir() else None
    if not record or not record["sittings"]:
        return "-"
    cmd = [str(c) for c in record["sittings"][0]["command"]]
    return shlex.join(["python", *cmd[1:]])


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--out", default="runs/demo_story", help="one run directory per mode and seed under it")
    ap.add_argument("--timeout", type=float, default=0.0,
                    help="stop a run after this many seconds (it resumes when the command is run again); 0: none")
    ap.add_argument("--table-only", action="store_true", help="print the table of the runs there, start none")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.table_only:
        base = demo_args()
        for seed in args.seeds:
            for mode, flags in MODES.items():
                cmd = [sys.executable, "-m", "fedlaunch", *base, *flags, "--seed", str(seed), *extra,
                       "--run-dir", str(out / f"{mode}-s{seed}")]
                launch_run(cmd, out / f"{mode}-s{seed}", args.timeout)
    text, ok = table(out, args.seeds)
    print(f"runs of: {recorded_command(out / f'on-s{args.seeds[0]}')} (seed {args.seeds[0]}, on; off adds "
          f"--nfl-mode off)")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
