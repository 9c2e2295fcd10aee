"""tools/bench/bench_targets.py: samples of the target cases over time, the figures over their lines counted, the
schedule kept (every, samples, deadline), and a failed run named."""

from __future__ import annotations

import subprocess

import pytest

from tools.bench import bench_targets as bt
from tools.bench.bench_pair import FIGURES

FLEET, K10 = bt.CASES


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_the_cases_lines_are_the_issues_and_name_figures_that_a_run_prints() -> None:
    assert FLEET.lines == {"server_ms_per_cr": 0.3, "round_s": 0.2} and K10.lines == {"round_s": 0.01}
    assert all(name in FIGURES for case in bt.CASES for name in case.lines)
    assert "--transport" in FLEET.args and "framed" in K10.args


def test_a_figure_over_its_line_is_counted_and_one_at_it_is_not() -> None:
    assert bt.over(FLEET, {"server_ms_per_cr": 0.301, "round_s": 0.05}) == ["server_ms_per_cr"]
    assert bt.over(FLEET, {"server_ms_per_cr": 0.3, "round_s": 0.2}) == []  # the line itself is met (≤)
    assert bt.over(K10, {"round_s": 0.0101, "between_s": 0.5}) == ["round_s"]  # a figure without a line never is
    samples = [bt.Sample("fleet", "03:00:00", {"server_ms_per_cr": 0.22, "round_s": 0.05}),
               bt.Sample("fleet", "03:03:00", {"server_ms_per_cr": 0.31, "round_s": 0.06}),
               bt.Sample("fleet", "03:06:00", {"server_ms_per_cr": 0.25, "round_s": 0.04}),
               bt.Sample("k10", "03:00:30", {"round_s": 0.006, "between_s": 0.008})]
    text = bt.summary(samples)
    assert "fleet (3 samples;" in text and "k10 (1 samples;" in text
    assert "server CPU per client-round, median of rounds (ms): min 0.22, median 0.25, max 0.31; over 0.3: 1 of 3" \
        in text
    assert "median round, start -> aggregated (s): min 0.04, median 0.05, max 0.06; over 0.2: 0 of 3" in text
    assert "wall seconds between completions (s): min 0.008, median 0.008, max 0.008\n" in text + "\n"
    assert bt.summary([]) == ""


def test_the_loop_keeps_its_schedule_and_stops_at_the_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    clock = _Clock()
    ran: list[str] = []

    def run(case: bt.Case) -> dict[str, float]:
        ran.append(case.name)
        clock.now += 40.0  # each run takes 40 s
        return {"round_s": 0.25 if case.name == "fleet" else 0.005}

    taken = bt.sample_loop(3, 180.0, None, run=run, clock=clock, sleep=clock.sleep)
    assert ran == ["fleet", "k10"] * 3 and len(taken) == 6
    assert clock.slept == [100.0, 100.0]  # each round starts 180 s after the previous one began; none after the last
    assert "OVER: round_s" in capsys.readouterr().out  # the fleet's 0.25 s round is over its 0.2 s line

    clock, ran = _Clock(), []
    taken = bt.sample_loop(10**9, 180.0, 400.0, run=run, clock=clock, sleep=clock.sleep)
    assert len(taken) == 6 and clock.now <= 400.0 + 80.0  # rounds began at 0, 180 and 360; none at 540
    clock, ran = _Clock(), []
    bt.sample_loop(3, 30.0, None, run=run, clock=clock, sleep=clock.sleep)
    assert clock.slept == []  # a round longer than --every: the next starts at once


def test_a_failed_run_is_named_with_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    def fake(*args: object, **kw: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess([], 3, "line 1\nthe server refused to start\n", "")

    monkeypatch.setattr(subprocess, "run", fake)
    with pytest.raises(RuntimeError,
                       match=r"k10: tools/bench/bench_rounds\.py exited with 3:\n(.|\n)*refused to start"):
        bt.run_case(K10)


@pytest.mark.parametrize("argv", [["--every", "0"], ["--minutes", "-1"], ["--samples", "0"], ["--case", "k11"]])
def test_bad_arguments_are_refused_before_anything_runs(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bt.main(argv)
    assert e.value.code == 2
