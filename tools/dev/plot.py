"""``python -m tools.dev.plot``: the checkout's way to run ``fedguard-plot`` (the code lives in :mod:`fedlaunch.plot`,
installed with the package; the ``plot`` extra brings matplotlib).

    python -m tools.dev.plot runs/mnist_nfl runs/mnist_ideal --out runs/mnist_beta.png
    python -m tools.dev.plot docs/results/cifar10_nfl.rounds.jsonl --timeline
"""

from __future__ import annotations

import sys

from fedlaunch.export import read_rounds
from fedlaunch.plot import main as _main
from fedlaunch.plot import moving_average, plot, run_label, timeline, transitions

__all__ = ["main", "moving_average", "plot", "read_rounds", "run_label", "timeline", "transitions"]


def main(argv: list[str] | None = None) -> int:
    return _main(argv, prog="python -m tools.dev.plot")


if __name__ == "__main__":
    sys.exit(main())
