"""What the launcher prints while a federation runs: the per-round table (also ``fedguard-status``'s), the
means of the last rounds, and a one-line progress indicator with an ETA."""

from __future__ import annotations

import math
import time
from typing import IO, Any

from fedcore.report import RoundReport  # no torch: --help stays fast

COLUMNS = ("round", "selected", "accepted", "rejected", "late", "abandoned", "train_loss", "test_acc", "beta_hat",
           "beta", "beta_b", "delta", "adapt", "nfl", "clusters", "dp_eps", "seconds")


_WIDTHS = (5, 8, 8, 8, 4, 9, 10, 8, 8, 7, 7, 8, 5, 12, 8, 8, 8)


def _fmt(v: float, digits: int = 4) -> str:
    return "-" if v != v else f"{v:.{digits}f}"  # NaN prints as "-"


def format_header() -> str:
    return " ".join(f"{c:>{w}}" for c, w in zip(COLUMNS, _WIDTHS, strict=True))


def format_row(h: RoundReport) -> str:
    """One round: late is the running total of uploads refused because their round had closed, abandoned the
    attempts of this round given up for too few updates before the one that completed; beta_hat is the round's
    median of the clients' beta_hat_i, beta the mean V_i - P_i on their full test splits, adapt the participants
    that ran their recovery, nfl the detector's state and count, clusters the number of DistFL clusters ("-"
    without DistFL or before the first clustering), delta LINDT's Delta = w_div - ||noise||, dp_eps the cumulative
    epsilon of server-side DP ("-" when not accounted; docs/privacy.md)."""
    nfl = h.nfl if h.nfl in ("off", "always") else f"{h.nfl}:{h.nfl_count}"
    if h.recovery and h.nfl == "watching":
        nfl += "+rec"  # long-term recovery carries on after a cancel
    return (f"{h.round:>5} {h.selected:>8} {h.accepted:>8} {h.rejected:>8} {h.late_total:>4} {h.attempt:>9} "
            f"{_fmt(h.mean_train_loss):>10} "
            f"{_fmt(h.mean_test_accuracy):>8} {_fmt(h.beta_hat, 3):>8} {_fmt(h.beta, 3):>7} "
            f"{_fmt(h.beta_benign, 3):>7} {_fmt(h.metrics.get('delta', math.nan), 3):>8} {h.adapting:>5} {nfl:>12} "
            f"{len(h.clusters) or '-':>8} {_eps(h.dp_epsilon):>8} {h.seconds:>8.3f}")


def _eps(v: float) -> str:
    """epsilon in 8 columns: 3 decimals while small, scientific notation when the noise gives no real privacy."""
    if v != v:
        return "-"
    return f"{v:.3f}" if v < 1000 else f"{v:.2e}"


def last_rounds_summary(history: list[RoundReport], last: int = 10) -> str:
    """Means over the last ``last`` rounds (the papers' convention), NaN-free values only."""
    tail = history[-last:]

    def mean(get: Any) -> str:
        vals = [v for v in (get(h) for h in tail) if v == v]
        return _fmt(sum(vals) / len(vals)) if vals else "-"

    return (f"last {len(tail)} rounds: test_acc {mean(lambda h: h.mean_test_accuracy)}, "
            f"benign test_acc {mean(lambda h: h.test_accuracy_benign)}, "
            f"beta {mean(lambda h: h.beta)}, "
            f"beta_benign {mean(lambda h: h.beta_benign)}, "
            f"central_acc {mean(lambda h: h.central_accuracy)}")


class Progress:
    """A one-line progress indicator with an ETA on a terminal; plain lines, at most every ``plain_every`` s,
    otherwise."""

    def __init__(self, out: IO[str], plain_every: float = 30.0) -> None:
        self.out = out
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.plain_every = plain_every
        self.last_plain = time.monotonic()
        self.shown = False

    def show(self, text: str) -> None:
        if self.tty:
            print(f"\r\x1b[2K{text}", end="", file=self.out, flush=True)
            self.shown = True
        elif time.monotonic() - self.last_plain >= self.plain_every:
            print(text, file=self.out, flush=True)
            self.last_plain = time.monotonic()

    def clear(self) -> None:
        if self.shown:
            print("\r\x1b[2K", end="", file=self.out, flush=True)
            self.shown = False


def eta(done: float, total: float, elapsed: float) -> str:
    """``ETA 1m05s`` from the rate so far ("ETA -" before any progress)."""
    if done <= 0 or total <= done:
        return "ETA -" if total > done else "ETA 0s"
    left = elapsed / done * (total - done)
    return f"ETA {int(left // 60)}m{int(left % 60):02d}s" if left >= 60 else f"ETA {left:.0f}s"
