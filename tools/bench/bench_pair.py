"""A change's effect on the round benchmark, measured side by side: ``tools/bench/bench_rounds.py`` run in two checkouts
at
the same time (the base and this tree), so both federations see the same machine, and the ratio of each figure.

One run at a time cannot separate a change of a few per cent from a small VM's drift (20–50 % within minutes on the
2-core machine, docs/benchmarks.md); two runs started together share whatever the machine does meanwhile, so their
ratio is what the change did. Each pair is two federations on one machine: the absolute figures are those of a loaded
machine, only the ratios are the result.

    python tools/bench/bench_pair.py --base 1f12660 -- --clients 500 -k 50 --virtual --procs 2 --rounds 60 \\
        --warmup 60 --transport framed
    python tools/bench/bench_pair.py --base 1f12660 --repeat 4 -- --rounds 300 --transport framed   # K = 10
    python tools/bench/bench_pair.py --base-dir ../other-checkout -- ...    # a checkout you made yourself

``--base REV`` checks REV out with ``git worktree add --detach`` into a new temporary directory and removes that
worktree (and only it) at the end; ``--base-dir DIR`` uses a checkout as it is. Everything after ``--`` goes to
``tools/bench/bench_rounds.py`` in both trees (each run with its own tree first on ``PYTHONPATH``). ``--keep DIR`` keeps
every run's output. Prints each pair's figures, each figure's ratio (this tree / base; below 1 is faster or cheaper),
and the median ratio over the pairs.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.runs import split_passthrough  # noqa: E402

# The figures read from tools/bench/bench_rounds.py's output: name -> (pattern of its line, what it is).
FIGURES: dict[str, tuple[str, str]] = {
    "round_s": (r"^median seconds per round \(start -> aggregated\):\s+([0-9.]+)",
                "median round, start -> aggregated (s)"),
    "between_s": (r"^wall seconds per round \(between completions\):\s+([0-9.]+)",
                  "wall seconds between completions (s)"),
    "server_between_ms_per_cr": (r"^server CPU seconds per round \(user \+ system, between completions\): [0-9.]+ "
                                 r"\(([0-9.]+) ms per client-round\)",
                                 "server CPU per client-round between completions (ms)"),
    "server_ms_per_cr": (r"^server CPU per client-round \(the round's CPU seconds / selected, K = \d+\): median "
                         r"([0-9.]+) ms", "server CPU per client-round, median of rounds (ms)"),
    "clients_ms_per_cr": (r"^client processes' CPU seconds per round .*?\(([0-9.]+) ms per client-round\)",
                          "client processes' CPU per client-round (ms)"),
}


def figures(output: str) -> dict[str, float]:
    """The :data:`FIGURES` found in one run's output (a figure whose line is missing is left out)."""
    found: dict[str, float] = {}
    for name, (pattern, _) in FIGURES.items():
        m = re.search(pattern, output, re.MULTILINE)
        if m is not None:
            found[name] = float(m.group(1))
    return found


@dataclass(frozen=True)
class Pair:
    base: dict[str, float]
    head: dict[str, float]

    def ratios(self) -> dict[str, float]:
        """head / base of every figure both runs have (a zero base figure is left out)."""
        return {k: self.head[k] / self.base[k] for k in FIGURES if k in self.base and k in self.head and self.base[k]}


def median_ratios(pairs: Sequence[Pair]) -> dict[str, float]:
    """Each figure's median ratio over the pairs that have it."""
    out: dict[str, float] = {}
    for name in FIGURES:
        values = [r[name] for r in (p.ratios() for p in pairs) if name in r]
        if values:
            out[name] = statistics.median(values)
    return out


def table(pairs: Sequence[Pair]) -> str:
    """Every pair's figures (base -> this tree, the ratio) and the median ratio, one line per figure."""
    lines = []
    medians = median_ratios(pairs)
    for name, (_, what) in FIGURES.items():
        cells = [f"{p.base[name]:g} -> {p.head[name]:g} ({p.head[name] / p.base[name]:.3f})"
                 for p in pairs if name in p.base and name in p.head and p.base[name]]
        if cells:
            lines.append(f"{what}: " + "; ".join(cells) + f"; median ratio {medians[name]:.3f}")
    return "\n".join(lines)


Runner = Callable[[Path, list[str]], "subprocess.Popen[str]"]


def bench_script(tree: Path) -> Path:
    """``tree``'s round benchmark: ``tools/bench/bench_rounds.py``, or ``tools/bench_rounds.py`` in a tree older than
    the tools' rooms (issue 54)."""
    new = tree / "tools" / "bench" / "bench_rounds.py"
    old = tree / "tools" / "bench_rounds.py"
    return new if new.is_file() or not old.is_file() else old


def start_bench(tree: Path, args: list[str]) -> subprocess.Popen[str]:
    """``tools/bench/bench_rounds.py args`` of ``tree``, its output captured (the tree first on PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen([sys.executable, str(bench_script(tree)), *args], cwd=tree, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_pair(base: Path, head: Path, args: list[str], start: Runner = start_bench,
             keep: Path | None = None, index: int = 0) -> Pair:
    """One pair: both runs started together, then waited for; raises RuntimeError naming a run that failed."""
    procs = {"base": start(base, args), "head": start(head, args)}
    outputs = {name: p.communicate()[0] for name, p in procs.items()}
    for name, p in procs.items():
        if keep is not None:
            (keep / f"pair{index}-{name}.txt").write_text(outputs[name])
        if p.returncode != 0:
            tail = "\n".join(outputs[name].splitlines()[-15:])
            raise RuntimeError(f"the {name} run of pair {index} exited with {p.returncode}:\n{tail}")
    return Pair(figures(outputs["base"]), figures(outputs["head"]))


def main(argv: Sequence[str] | None = None) -> int:
    argv, bench_args = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base", metavar="REV", help="the commit to compare with (checked out in a temporary worktree)")
    where.add_argument("--base-dir", type=Path, metavar="DIR", help="a checkout to compare with, used as it is")
    ap.add_argument("--repeat", type=int, default=3, help="pairs to run, one after the other (default 3)")
    ap.add_argument("--keep", type=Path, metavar="DIR", help="write every run's output into DIR")
    a = ap.parse_args(argv)
    if a.repeat < 1:
        ap.error("--repeat: at least 1")
    if a.keep is not None:
        a.keep.mkdir(parents=True, exist_ok=True)
    made: Path | None = None
    if a.base_dir is not None:
        base = a.base_dir.resolve()
        if not bench_script(base).is_file():
            ap.error(f"--base-dir: {base} has no tools/bench/bench_rounds.py")
    else:
        made = Path(tempfile.mkdtemp(prefix="fedguard-base-")) / "tree"
        done = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(made), a.base],
                              capture_output=True, text=True)
        if done.returncode != 0:
            ap.error(f"--base {a.base}: git worktree add failed: {done.stderr.strip()}")
        base = made
    try:
        pairs = []
        for i in range(a.repeat):
            pair = run_pair(base, ROOT, bench_args, keep=a.keep, index=i)
            pairs.append(pair)
            print(f"pair {i + 1} of {a.repeat}: " + ", ".join(f"{k} {pair.base.get(k, float('nan')):g} -> "
                                                            f"{pair.head.get(k, float('nan')):g}" for k in FIGURES),
                  flush=True)
        print(f"base {a.base or base} against this tree ({ROOT}), {a.repeat} pair(s) of tools/bench/bench_rounds.py "
              f"{' '.join(bench_args)}; ratio = this tree / base:")
        print(table(pairs))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        if made is not None:  # the worktree this run made, and nothing else
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(made)], capture_output=True)
            made.parent.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
