"""fedguard-plot: figures of one or more runs (needs the ``plot`` extra: ``pip install 'fedguard[plot]'``).

    fedguard-plot runs/mnist_nfl runs/mnist_ideal --out runs/mnist_beta.png
    fedguard-plot docs/results/cifar10_nfl.rounds.jsonl --timeline runs/cifar_timeline.png

Reads each run directory's ``rounds.jsonl`` (or a ``*.rounds.jsonl`` file named directly).

Accuracy and beta (the default figure, ``--out``): top panel, the clients' mean local test accuracy of the model
they received (solid) and, when the server evaluated it, the central accuracy (dashed); bottom panel, beta over
benign clients (solid) and over all clients (dotted), with its 10-round moving average (thick).

Timeline (``--timeline [FILE]``, of the first run): the round's median beta_hat and the detector's beta_hat (the
mean of the last c medians), LINDT's Delta, and the NFL state machine (off, watching, reported, always-recover)
with the rounds where recovery is on shaded; every report (red) and cancel (green) is marked across the panels.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from fedlaunch.export import NFL_CODES, RunFileError, read_rounds

NFL_NAMES = {code: name for name, code in NFL_CODES.items()}


def run_label(run: Path) -> str:
    return run.name.removesuffix(".jsonl").removesuffix(".rounds") if run.is_file() else run.name


def moving_average(values: list[float], window: int = 10) -> list[float]:
    out = []
    for i in range(len(values)):
        vals = [v for v in values[max(0, i - window + 1) : i + 1] if not math.isnan(v)]
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _rows(run: Path) -> list[dict[str, Any]]:
    try:
        return read_rounds(run)
    except RunFileError as e:
        raise SystemExit(f"plot: {e}") from None


def transitions(rows: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The rounds at which NFL was reported (the state became "reported") and cancelled (it left "reported")."""
    reports, cancels = [], []
    prev = "off"
    for h in rows:
        state = str(h.get("nfl", "off"))
        if state == "reported" and prev != "reported":
            reports.append(int(h["round"]))
        elif prev == "reported" and state != "reported":
            cancels.append(int(h["round"]))
        prev = state
    return reports, cancels


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[Path], out: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, (ax_acc, ax_beta) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for i, run in enumerate(runs):
        rows = _rows(run)
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
    return _save(plt, fig, out)


def timeline(run: Path, out: Path, title: str = "") -> Path:
    """beta_hat, Delta and the NFL state per round, reports and cancels marked."""
    plt = _pyplot()
    rows = _rows(run)
    nan = math.nan
    r = [h["round"] for h in rows]
    fig, (ax_bh, ax_d, ax_nfl) = plt.subplots(3, 1, figsize=(9, 8), sharex=True,
                                              gridspec_kw={"height_ratios": [3, 2, 1.4]})
    ax_bh.plot(r, [h.get("beta_hat", nan) for h in rows], color="C0", alpha=0.45, label="round median beta_hat")
    ax_bh.plot(r, [h.get("beta_hat_avg", nan) for h in rows], color="C0", linewidth=2.2,
               label="detector beta_hat (mean of last c)")
    ax_bh.axhline(0.0, color="black", linewidth=0.8)
    ax_bh.set_ylabel("beta_hat")
    ax_d.plot(r, [h.get("metrics", {}).get("delta", nan) for h in rows], color="C1", label="Delta = w_div - |noise|")
    ax_d.set_ylabel("Delta")
    codes = [NFL_CODES.get(str(h.get("nfl", "off")), 0) for h in rows]
    ax_nfl.step(r, codes, where="post", color="C3", label="NFL state")
    rec = [bool(h.get("recovery", False)) for h in rows]
    ax_nfl.fill_between(r, 0, 1, where=rec, step="post", color="C2", alpha=0.2,
                        transform=ax_nfl.get_xaxis_transform(), label="recovery on")
    ax_nfl.set_yticks(sorted(NFL_NAMES), [NFL_NAMES[c] for c in sorted(NFL_NAMES)])
    ax_nfl.set_ylim(-0.4, 3.4)
    ax_nfl.set_xlabel("round")
    reports, cancels = transitions(rows)
    for ax in (ax_bh, ax_d, ax_nfl):
        for x in reports:
            ax.axvline(x, color="red", linestyle="--", linewidth=1.0)
        for x in cancels:
            ax.axvline(x, color="green", linestyle="--", linewidth=1.0)
    for x in reports:
        ax_bh.annotate(f"report r{x}", (x, 1.0), xycoords=("data", "axes fraction"), color="red", fontsize=8,
                       ha="left", va="top", rotation=90)
    for x in cancels:
        ax_bh.annotate(f"cancel r{x}", (x, 1.0), xycoords=("data", "axes fraction"), color="green", fontsize=8,
                       ha="left", va="top", rotation=90)
    for ax in (ax_bh, ax_d, ax_nfl):
        ax.legend(fontsize=8, loc="lower left")
    ax_bh.set_title(title or f"{run_label(run)}: beta_hat, Delta and the NFL state")
    return _save(plt, fig, out)


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None, prog: str = "fedguard-plot") -> int:
    from fedcore.about import VersionAction

    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=VersionAction)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories or rounds.jsonl files")
    ap.add_argument("--out", type=Path, help="PNG path (default: <first run>/accuracy_beta.png)")
    ap.add_argument("--timeline", nargs="?", type=Path, const=Path(), default=None, metavar="FILE",
                    help="also draw the first run's beta_hat/Delta/NFL timeline (default: <first run>/timeline.png)")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot: matplotlib is not installed; pip install 'fedguard[plot]'", file=sys.stderr)
        return 2
    first = args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent
    print(plot(args.runs, args.out or first / "accuracy_beta.png", args.title))
    if args.timeline is not None:
        dest = args.timeline if args.timeline != Path() else first / "timeline.png"
        print(timeline(args.runs[0], dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
