from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tools.dev.plot import main, moving_average, run_label


def test_moving_average_skips_nan() -> None:
    assert moving_average([1.0, math.nan, 3.0], window=2) == [1.0, 1.0, 3.0]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"round": r, "mean_test_accuracy": 0.1 * r, "central_accuracy": 0.1 * r, "beta": 0.01 * r - 0.05,
             "beta_benign": 0.02 * r - 0.05, "metrics": {}} for r in range(1, 8)]
    (run / "rounds.jsonl").write_text("\n".join(json.dumps(h) for h in rows))
    out = tmp_path / "p.png"
    assert main([str(run), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A rounds file named directly (as kept in docs/results) works too and is labelled by its stem.
    kept = tmp_path / "cifar10_nfl.rounds.jsonl"
    kept.write_text((run / "rounds.jsonl").read_text())
    assert run_label(kept) == "cifar10_nfl"
    assert main([str(kept), str(run)]) == 0 and (tmp_path / "accuracy_beta.png").exists()


def test_plot_refuses_a_directory_without_rounds(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"rounds\.jsonl"):
        main([str(tmp_path)])
