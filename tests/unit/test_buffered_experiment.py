"""tools/experiments/buffered.py: the time-to-accuracy table recomputed from the committed rows (the figures
docs/results/buffered.md quotes), the time to a target, and a tagged variant of the buffered arm."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tools.experiments import buffered as bx

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "buffered"


@pytest.mark.parametrize(("rows_dir", "speedups"), [
    (RESULTS / "idle", ["4.50x", "2.10x", "3.32x"]),  # the table of record (the idle machine)
    (RESULTS, ["2.53x", "1.11x", "2.30x"]),  # the first sample (the loaded VM)
])
def test_the_committed_rows_give_the_figures_the_results_page_quotes(
        rows_dir: Path, speedups: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert bx.main(["report", str(rows_dir), "--target", "0.85", "--window", "5"]) == 0
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): [c.strip() for c in line.strip("|").split("|")]
            for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "seed" not in line}
    page = (ROOT / "docs" / "results" / "buffered.md").read_text()
    for seed in ("0", "1", "2"):
        sync, buf = rows[(seed, "sync")], rows[(seed, "buffered")]
        # | seed | sync: wall | sync: updates | sync: final | buffered: wall | buffered: updates | buffered: final
        # | buffered at 400 updates | speed-up |
        quoted = (f"| {seed} | {sync[3]} | {sync[4]} | {sync[6]} | {buf[3]} | {buf[4]} | {buf[6]} | {buf[7]} | "
                  f"**{buf[9].replace('x', '×')}** |")
        assert quoted in page, quoted
    assert [rows[(s, "buffered")][9] for s in ("0", "1", "2")] == speedups


def test_time_to_target_counts_from_round_one_and_averages_the_window() -> None:
    rows = [{"round": i, "seconds": 2.0, "wall_seconds": 10.0 + 2.0 * i, "accepted": 10, "central_accuracy": a}
            for i, a in enumerate([0.5, 0.8, 0.9, 0.95, 0.7], start=1)]
    # Round 1 started at 12 - 2 = 10 s; the mean of rounds 2-3 first reaches 0.85 at round 3 (16 s).
    for target, window in ((0.85, 2), (0.9, 1)):
        hit = bx.time_to_target(rows, target, window=window)
        assert hit is not None and hit[0] == pytest.approx(6.0) and hit[1:] == (30, 3)
    assert bx.time_to_target(rows, 0.99, window=1) is None
    assert bx.final_accuracy(rows[:2]) == pytest.approx(0.65)


def test_a_tagged_variant_sets_only_the_buffered_runs(tmp_path: Path) -> None:
    args = argparse.Namespace(out=str(tmp_path), seeds=[3], modes=["sync", "buffered"], rounds=40, tag="lr2",
                              buffered_set=["server_optimizer.name='fedavgm'"])
    sync, buf = bx.jobs(args)
    assert (sync.name, buf.name) == ("sync-s3", "buffered-lr2-s3")
    assert "server_optimizer.name='fedavgm'" not in sync.cmd and "buffered_set" not in sync.spec
    i = buf.cmd.index("server_optimizer.name='fedavgm'")
    assert buf.cmd[i - 1] == "--server-set" and buf.spec["buffered_set"] == ["server_optimizer.name='fedavgm'"]
    # Untagged, the runs and their specs are the committed campaign's (so its run dirs still resume).
    plain = bx.jobs(argparse.Namespace(out=str(tmp_path), seeds=[3], modes=["buffered"], rounds=40, tag="",
                                       buffered_set=None))
    assert plain[0].name == "buffered-s3" and "buffered_set" not in plain[0].spec
    with pytest.raises(SystemExit, match="needs a --tag"):
        bx.jobs(argparse.Namespace(out=str(tmp_path), seeds=[3], modes=["buffered"], rounds=40, tag="",
                                   buffered_set=["rounds.concurrency=10"]))
