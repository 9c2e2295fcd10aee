"""Issue 30's round targets measured over the VM's spells: ``tools/bench/bench_rounds.py``'s two target cases run in
turn
every ``--every`` seconds, each sample's figures printed as it comes, then each figure's minimum, median and maximum
and how many samples were over its line.

A small shared VM runs 20–50 % slower in some stretches than in others (docs/benchmarks.md); one run says little about
whether a target holds on the machine, a sample every few minutes over an hour says how often it does. The cases and
their lines (issue 30, item 2; the commands docs/benchmarks.md gives):

- ``fleet``: ``--clients 1000 -k 100 --virtual --procs 4 --rounds 60 --warmup 60 --transport framed``; server CPU per
  client-round (median of rounds) ≤ 0.3 ms, median round ≤ 0.2 s;
- ``k10``: ``--rounds 300 --transport framed``; median round (start -> aggregated) ≤ 0.01 s.

    python tools/bench/bench_targets.py --minutes 60 --every 180    # a sample of both cases every 3 minutes for an hour
    python tools/bench/bench_targets.py --samples 1                  # one of each, now
    python tools/bench/bench_targets.py --minutes 50 --every 180 --figures docs/figures.toml   # and update the figures

With ``--figures PATH`` the min–max over the samples becomes the current value (dated today) of the figures
``round_overhead_k10`` (k10's round), ``fleet_1000_round`` and ``fleet_1000_server_cpu`` in that file
(tools/dev/figures.py); ``tests/unit/test_figures.py`` then names every page still quoting the old value.

The figures are :data:`tools.bench.bench_pair.FIGURES` (the same parsing). Run it on an otherwise idle machine: a test
suite or a build beside it is a slow spell of its own making.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.bench.bench_pair import FIGURES, figures  # noqa: E402
from tools.dev import figures as figures_file  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    lines: dict[str, float]  # figure -> its target: the sample is over the line when the figure exceeds it


CASES: tuple[Case, ...] = (
    Case("fleet", ("--clients", "1000", "-k", "100", "--virtual", "--procs", "4", "--rounds", "60", "--warmup", "60",
                   "--transport", "framed"),
         {"server_ms_per_cr": 0.3, "round_s": 0.2}),
    Case("k10", ("--rounds", "300", "--transport", "framed"), {"round_s": 0.01}),
)


@dataclass(frozen=True)
class Sample:
    case: str
    at: str  # UTC time of day the run started
    figures: dict[str, float]


def run_case(case: Case) -> dict[str, float]:
    """One ``tools/bench/bench_rounds.py`` run of ``case``; raises RuntimeError with the output's tail when it fails."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "bench_rounds.py"), *case.args], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise RuntimeError(f"{case.name}: tools/bench/bench_rounds.py exited with {done.returncode}:\n{tail}")
    return figures(done.stdout)


def over(case: Case, found: dict[str, float]) -> list[str]:
    """The figures of one sample of ``case`` over their lines."""
    return [name for name, line in case.lines.items() if name in found and found[name] > line]


def summary(samples: Sequence[Sample], cases: Sequence[Case] = CASES) -> str:
    """Per case and figure: min / median / max over the samples, and for a figure with a line how many are over it."""
    out = []
    for case in cases:
        mine = [s for s in samples if s.case == case.name]
        if not mine:
            continue
        out.append(f"{case.name} ({len(mine)} samples; tools/bench/bench_rounds.py {' '.join(case.args)}):")
        for name, (_, what) in FIGURES.items():
            values = [s.figures[name] for s in mine if name in s.figures]
            if not values:
                continue
            line = case.lines.get(name)
            verdict = "" if line is None else \
                f"; over {line:g}: {sum(v > line for v in values)} of {len(values)}"
            out.append(f"  {what}: min {min(values):g}, median {statistics.median(values):g}, "
                       f"max {max(values):g}{verdict}")
    return "\n".join(out)


def sample_loop(samples: int, every_s: float, deadline: float | None,
                run: Callable[[Case], dict[str, float]] = run_case, clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep, cases: Sequence[Case] = CASES) -> list[Sample]:
    """Up to ``samples`` rounds of every case (each round starting ``every_s`` after the previous one began, or at
    once when the previous took longer), none starting after ``deadline`` (a ``clock`` time; None: no deadline)."""
    taken: list[Sample] = []
    for i in range(samples):
        began = clock()
        if deadline is not None and began > deadline:
            break
        for case in cases:
            at = time.strftime("%H:%M:%S", time.gmtime())
            found = run(case)
            taken.append(Sample(case.name, at, found))
            flags = over(case, found)
            print(f"{at} {case.name}: " + ", ".join(f"{k} {v:g}" for k, v in found.items())
                  + (f"  OVER: {', '.join(flags)}" if flags else ""), flush=True)
        if i + 1 < samples:
            wait = every_s - (clock() - began)
            if deadline is not None:
                wait = min(wait, deadline - clock())
            if wait > 0:
                sleep(wait)
    return taken


# docs/figures.toml entries this tool measures: name -> (case, figure, format of each end of the range).
FIGURE_ENTRIES: dict[str, tuple[str, str, str]] = {
    "round_overhead_k10": ("k10", "round_s", "{:.4f}"),
    "fleet_1000_round": ("fleet", "round_s", "{:.3f}"),
    "fleet_1000_server_cpu": ("fleet", "server_ms_per_cr", "{:.3f}"),
}


def figure_values(samples: Sequence[Sample]) -> dict[str, str]:
    """The figures-file values (min–max over the samples) of :data:`FIGURE_ENTRIES` the samples have."""
    out = {}
    for name, (case, figure, fmt) in FIGURE_ENTRIES.items():
        values = [s.figures[figure] for s in samples if s.case == case and figure in s.figures]
        if values:
            out[name] = figures_file.span(values, fmt)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=None, help="start no sample after this long (default: none)")
    ap.add_argument("--every", type=float, default=180.0, help="seconds from one sample's start to the next's "
                                                               "(default 180)")
    ap.add_argument("--samples", type=int, default=None, help="at most this many samples of each case (default: as "
                                                              "many as --minutes allows, else 1)")
    ap.add_argument("--case", choices=[c.name for c in CASES], action="append",
                    help="only this case (repeatable; default: both)")
    ap.add_argument("--figures", type=Path, metavar="PATH",
                    help="update this figures file (docs/figures.toml) with the samples' min–max")
    a = ap.parse_args(argv)
    if a.every <= 0:
        ap.error("--every: more than 0 seconds")
    if a.minutes is not None and a.minutes <= 0:
        ap.error("--minutes: more than 0")
    if a.samples is not None and a.samples < 1:
        ap.error("--samples: at least 1")
    samples = a.samples if a.samples is not None else (1 if a.minutes is None else 10**9)
    deadline = None if a.minutes is None else time.monotonic() + a.minutes * 60.0
    cases = [c for c in CASES if a.case is None or c.name in a.case]
    try:
        taken = sample_loop(samples, a.every, deadline, cases=cases)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(summary(taken, cases))
    if a.figures is not None:
        for name, value in figure_values(taken).items():
            figures_file.update(a.figures, name, value)
            print(f"{a.figures}: {name} = {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
