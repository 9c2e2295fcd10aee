"""Draw accuracy and beta per round of one or more runs to a PNG (needs the ``plot`` extra: matplotlib).

    python -m tools.plot runs/mnist_nfl runs/mnist_ideal --out runs/mnist_beta.png
    python -m tools.plot docs/results/cifar10_nfl.rounds.jsonl docs/results/cifar10_ideal.rounds.jsonl --out x.png

Reads each run directory's ``rounds.jsonl`` (or a ``*.rounds.jsonl`` file named directly). Top panel: the
clients' mean local test accuracy of the model they received (solid) and, when the server evaluated it, the
central accuracy (dashed). Bottom panel: beta over benign clients (solid) and over all clients (dotted), with
its 10-round moving average (thick).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def read_rounds(run: Path) -> list[dict[str, Any]]:
    """The rounds of a run directory (its ``rounds.jsonl``) or of a rounds file named directly."""
    path = run if run.is_file() else run / "rounds.jsonl"
    if not path.exists():
        raise SystemExit(f"plot: {path} does not exist (is {run} a fedguard run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_label(run: Path) -> str:
    return run.name.removesuffix(".jsonl").removesuffix(".rounds") if run.is_file() else run.name


def moving_average(values: list[float], window: int = 10) -> list[float]:
    out = []
    for i in range(len(values)):
        vals = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def plot(runs: list[Path], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_beta) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for i, run in enumerate(runs):
        rows = read_rounds(run)
        name = run_label(run)
        color = f"C{i}"
        r = [h["round"] for h in rows]
        nan = math.nan
        ax_acc.plot(r, [h.get("mean_test_accuracy", nan) for h in rows], color=color, label=f"{name}: local")
        central = [h.get("central_accuracy", nan) for h in rows]
        if any(not math.isnan(c) for c in central):
            ax_acc.plot(r, central, color=color, linestyle="--", label=f"{name}: central")
        beta_b = [h.get("beta_benign", nan) for h in rows]
        ax_beta.plot(r, beta_b, color=color, alpha=0.35)
        ax_beta.plot(r, moving_average(beta_b), color=color, linewidth=2.2, label=f"{name}: benign beta (MA10)")
        ax_beta.plot(r, [h.get("beta", nan) for h in rows], color=color, linestyle=":", alpha=0.6,
                     label=f"{name}: beta, all clients")
    ax_beta.axhline(0.0, color="black", linewidth=0.8)
    ax_acc.set_ylabel("test accuracy")
    ax_beta.set_ylabel("beta = V_i - P_i")
    ax_beta.set_xlabel("round")
    ax_acc.legend(fontsize=8)
    ax_beta.legend(fontsize=8)
    ax_acc.set_title(title or " vs ".join(run_label(run) for run in runs))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories or rounds.jsonl files")
    ap.add_argument("--out", type=Path, help="PNG path (default: <first run>/accuracy_beta.png)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot: matplotlib is not installed; pip install 'fedguard[plot]'", file=sys.stderr)
        return 2
    first = args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent
    out = plot(args.runs, args.out or first / "accuracy_beta.png", args.title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
