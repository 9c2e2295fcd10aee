"""tools/bench/bench_pair.py: the figures read from tools/bench/bench_rounds.py's output, the ratios of a pair and their
medians,
a pair's two runs started together, and a failed run named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import bench_pair as bp

# The lines of a real run (tools/bench/bench_rounds.py --clients 500 -k 50 --virtual --procs 2 ..., 2026-11-27).
OUTPUT = """K = 50 of N = 500 clients (threads of 2 process(es); a Session stream each on the framed port)
median seconds per round (start -> aggregated): 0.0383  (min 0.0226, max 0.0657)
wall seconds per round (between completions):   0.0431
server CPU seconds per round (user + system, between completions): 0.0133 (0.267 ms per client-round)
client processes' CPU seconds per round (all of them, same span): 0.0272 (0.543 ms per client-round); with
peak RSS server: 902 MiB; client process: median 948 MiB, max 951 MiB
server CPU per client-round (the round's CPU seconds / selected, K = 50): median 0.266 ms (min 0.227, max 0.313)
"""


def test_the_figures_of_a_runs_output_are_read_and_a_missing_line_is_left_out() -> None:
    assert bp.figures(OUTPUT) == {"round_s": 0.0383, "between_s": 0.0431, "server_between_ms_per_cr": 0.267,
                                  "server_ms_per_cr": 0.266, "clients_ms_per_cr": 0.543}
    assert set(bp.figures(OUTPUT)) == set(bp.FIGURES)  # every figure has its line in a real output
    partial = "\n".join(line for line in OUTPUT.splitlines() if not line.startswith("wall"))
    assert "between_s" not in bp.figures(partial) and bp.figures("nothing") == {}


def test_a_pairs_ratios_their_medians_and_the_table() -> None:
    pairs = [bp.Pair({"round_s": 0.010, "server_ms_per_cr": 0.30}, {"round_s": 0.009, "server_ms_per_cr": 0.27}),
             bp.Pair({"round_s": 0.020, "server_ms_per_cr": 0.0}, {"round_s": 0.022, "server_ms_per_cr": 0.2}),
             bp.Pair({"round_s": 0.010}, {"round_s": 0.008})]
    assert pairs[0].ratios() == pytest.approx({"round_s": 0.9, "server_ms_per_cr": 0.9})
    assert pairs[1].ratios() == pytest.approx({"round_s": 1.1})  # a zero base figure has no ratio
    assert bp.median_ratios(pairs) == pytest.approx({"round_s": 0.9, "server_ms_per_cr": 0.9})
    text = bp.table(pairs)
    assert "median round, start -> aggregated (s): 0.01 -> 0.009 (0.900); 0.02 -> 0.022 (1.100); " \
           "0.01 -> 0.008 (0.800); median ratio 0.900" in text
    assert "between completions" not in text  # no pair has it


def _fake(lines: dict[str, str], fail: str = "", meet: Path | None = None) -> bp.Runner:
    """A runner that prints ``lines[tree name]`` (exit 3 for the tree named ``fail``). With ``meet``, each run
    first marks itself started there and waits (up to 10 s) for the other tree's mark, then records whether it saw
    it: two runs that overlap both see each other, whatever the machine's load."""
    def start(tree: Path, args: list[str]) -> subprocess.Popen[str]:
        wait = ""
        if meet is not None:
            other = "head" if tree.name == "base" else "base"
            wait = (f"import pathlib; m = pathlib.Path({str(meet)!r}); (m / '{tree.name}.started').touch(); "
                    f"t = time.monotonic() + 10\n"
                    f"while not (m / '{other}.started').exists() and time.monotonic() < t: time.sleep(0.01)\n"
                    f"if (m / '{other}.started').exists(): (m / '{tree.name}.saw_{other}').touch()\n")
        code = (f"import time, sys\n{wait}print({lines[tree.name]!r}); "
                f"sys.exit({3 if tree.name == fail else 0})")
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return start


def test_a_pairs_runs_start_together_and_a_failed_run_is_named(tmp_path: Path) -> None:
    base, head, meet = tmp_path / "base", tmp_path / "head", tmp_path / "meet"
    meet.mkdir()
    slower = OUTPUT.replace("0.0383", "0.0400")
    pair = bp.run_pair(base, head, [], start=_fake({"base": slower, "head": OUTPUT}, meet=meet), keep=tmp_path,
                       index=2)
    # Each run waited for the other to start: run one after the other, the first would not have seen the second.
    assert sorted(p.name for p in meet.glob("*.saw_*")) == ["base.saw_head", "head.saw_base"]
    assert (pair.base["round_s"], pair.head["round_s"]) == (0.04, 0.0383)
    assert (tmp_path / "pair2-base.txt").read_text().startswith("K = 50")
    with pytest.raises(RuntimeError, match="the head run of pair 0 exited with 3"):
        bp.run_pair(base, head, [], start=_fake({"base": OUTPUT, "head": "boom"}, fail="head"))


def test_a_base_dir_without_the_benchmark_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        bp.main(["--base-dir", str(tmp_path), "--", "--rounds", "1"])
    assert e.value.code == 2 and "has no tools/bench/bench_rounds.py" in capsys.readouterr().err
