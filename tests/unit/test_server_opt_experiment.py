"""The server-optimizer experiment (tools/experiments/server_opt_experiment.py, issue 50 item 2): its arguments, the
runs it
plans and their launcher commands, how it reads runs back and picks each arm's learning rate, and the committed
tables (docs/results/server_opt.md) recomputed from the committed per-round files. No federation is started."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tools.experiments import server_opt_experiment as so
from tools.experiments.nfl_experiment import BEGIN, END

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def _parse(*argv: str) -> Any:
    return so.build_parser().parse_args(list(argv))


# ---- arguments and plan ----

def test_the_grid_plans_every_arm_and_learning_rate_on_seed_0() -> None:
    args = _parse("run", "--grid", "--out", "x")
    assert args.seeds == [0] and args.parallel == 2 and args.rounds == 0 and args.timeout == 0.0
    runs = so.plan(args.arms, so.chosen_lrs(args), args.seeds)
    assert [r.name for r in runs] == [
        "fedavg-1-s0", "fedavgm-0.1-s0", "fedavgm-0.3-s0", "fedavgm-1-s0", "fedavgm-3-s0",
        "fedavgm-10-s0", "fedadam-0.003-s0", "fedadam-0.01-s0", "fedadam-0.03-s0", "fedadam-0.1-s0",
        "fedyogi-0.003-s0", "fedyogi-0.01-s0", "fedyogi-0.03-s0", "fedyogi-0.1-s0"]


def test_named_learning_rates_and_seeds() -> None:
    args = _parse("run", "--lr", "fedadam=0.01", "fedavgm=0.3,1", "--seeds", "1", "2", "--arms", "fedavg",
                  "fedavgm", "fedadam")
    assert so.chosen_lrs(args) == {"fedadam": [0.01], "fedavgm": [0.3, 1.0]}
    names = [r.name for r in so.plan(args.arms, so.chosen_lrs(args), args.seeds)]
    # fedavg always has its one setting; fedyogi is not among --arms
    assert names == ["fedavg-1-s1", "fedavgm-0.3-s1", "fedavgm-1-s1", "fedadam-0.01-s1",
                     "fedavg-1-s2", "fedavgm-0.3-s2", "fedavgm-1-s2", "fedadam-0.01-s2"]


@pytest.mark.parametrize("item", ["fedadam", "sgd=0.1", "fedadam=fast", "fedadam=", "fedadam=-0.1",
                                  "fedavg=0.5"])
def test_bad_learning_rates_are_refused(item: str) -> None:
    with pytest.raises(ValueError):
        so.parse_lrs([item])


def test_unknown_arm_is_an_argument_error() -> None:
    with pytest.raises(SystemExit):
        _parse("run", "--arms", "fedprox")


def test_the_launcher_command_and_spec() -> None:
    args = _parse("run", "--rounds", "7")
    r = so.PlannedRun("fedyogi", 0.03, 2)
    cmd = so.launch_cmd(r, Path("/c/fedyogi-0.03-s2"), 7, args)
    assert cmd[1:5] == ["-m", "fedlaunch", "--config", so.CONFIG]
    for flag, value in (("--run-dir", "/c/fedyogi-0.03-s2"), ("--seed", "2"), ("--rounds", "7"),
                        ("--torch-threads", "1")):
        assert cmd[cmd.index(flag) + 1] == value
    assert "--insecure" in cmd
    sets = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--server-set"]
    assert 'server_optimizer.name="fedyogi"' in sets
    assert "server_optimizer.options={lr = 0.03, beta1 = 0.9, beta2 = 0.99, tau = 1e-3, bias_correction = false}" \
        in sets
    assert so.arm_args("fedavg", 1.0) == []
    assert so.arm_args("fedavgm", 1.0)[-1] == "server_optimizer.options={lr = 1.0, momentum = 0.9}"
    spec = so.run_spec(r, 7)
    assert spec["arm"] == "fedyogi" and spec["server_lr"] == 0.03 and spec["seed"] == 2 and spec["rounds"] == 7
    assert spec["client_lr"] == 0.05  # the config's, the same in every arm


def test_the_options_tables_are_valid_server_optimizer_options() -> None:
    from fedcore.server_opt.config import ServerOptimizerConfig

    for arm in ("fedavgm", "fedadam", "fedyogi"):
        for lr in so.GRID[arm]:
            table = so.arm_args(arm, lr)[-1].split("=", 1)[1]
            options = tomllib.loads(f"options = {table}")["options"]
            opts = ServerOptimizerConfig(name=arm, options=options).parsed_options()
            assert opts.lr == lr
            if arm != "fedavgm":
                assert opts.tau == 1e-3 and opts.beta1 == 0.9 and opts.beta2 == 0.99


def test_dry_run_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert so.main(["run", "--arms", "fedadam", "--lr", "fedadam=0.01", "--out", str(tmp_path / "c"),
                    "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "fedadam-0.01-s0: new" in out and "-m fedlaunch" in out
    assert list((tmp_path / "c").iterdir()) == []


# ---- reading runs back ----

def _rows(accs: list[float]) -> str:
    return "".join(json.dumps({"round": i + 1, "outcome": "quorum", "central_accuracy": a, "seconds": 0.5,
                               "metrics": {}}) + "\n" for i, a in enumerate(accs))


def test_names_figures_and_the_choice(tmp_path: Path) -> None:
    (tmp_path / "fedadam-0.01-s0.rounds.jsonl").write_text(_rows([0.5, 0.9, 0.9, 0.9, 0.9, 0.9]))
    (tmp_path / "fedadam-0.03-s0.rounds.jsonl").write_text(_rows([0.8, 0.8, 0.8, 0.8, 0.8, 0.8]))
    (tmp_path / "fedadam-0.03-s1.rounds.jsonl").write_text(_rows([0.1, 0.99]))
    (tmp_path / "fedadam-0.01-s1.rounds.jsonl").write_text(_rows([0.2, 0.4, 0.86]))
    (tmp_path / "fedavg-1-s0.rounds.jsonl").write_text(_rows([0.3, 0.6]))
    (tmp_path / "fedavgm-1e-05-s0.rounds.jsonl").write_text(_rows([0.1]))
    runs = so.load_runs([str(tmp_path)])
    assert set(runs) == {("fedadam", 0.01, 0), ("fedadam", 0.03, 0), ("fedadam", 0.03, 1), ("fedadam", 0.01, 1),
                         ("fedavg", 1.0, 0), ("fedavgm", 1e-5, 0)}
    rd = runs[("fedadam", 0.01, 0)]
    assert rd.last() == 0.9 and math.isclose(rd.last_mean(), 0.9) and rd.first_at(0.85) == 2
    assert runs[("fedavg", 1.0, 0)].first_at(0.85) is None
    # seed 0 decides, not seed 1's better 0.03 run
    assert so.best_lrs(runs) == {"fedavg": 1.0, "fedavgm": 1e-5, "fedadam": 0.01}
    text = so.render(runs, 0.85)
    # seed 0: last 0.9, last 5 0.9, round 2; seed 1: last 0.86, last 5 (0.2 + 0.4 + 0.86) / 3, round 3
    assert "| **fedadam** | **0.01** | **mean of 2** |  | **0.880** ± 0.028 | **0.693** ± 0.292 | **2.5** |" in text
    assert "| **fedavg** | **1** | **mean of 1** |  | **0.600** ± - | **0.450** ± - | **-** |" in text
    # a setting other than the choice that ran on another seed has its rows too, not bold, not in the order
    assert "| fedadam | 0.03 | mean of 2 |  | 0.895 ± 0.134 | 0.673 ± 0.180 | 2.0 (1/2) |" in text
    assert "Order of the choices by the mean over seeds of the last-5 mean: fedadam (lr 0.01) 0.693 > " \
           "fedavg (lr 1) 0.450 > fedavgm (lr 1e-05) 0.100" in text


# ---- the committed results ----

def _block(md: Path) -> str:
    doc = md.read_text()
    return doc.split(BEGIN + "\n", 1)[1].split("\n" + END, 1)[0]


def test_the_committed_tables_are_recomputed_from_the_committed_rounds() -> None:
    md, runs_dir = RESULTS / "server_opt.md", RESULTS / "server_opt"
    files = sorted(runs_dir.glob("*.rounds.jsonl"))
    assert files, "no committed runs"
    runs = so.load_runs([str(runs_dir)])
    assert len(runs) == len(files)
    target = float(re.search(r"first round >= ([0-9.]+)", _block(md)).group(1))  # type: ignore[union-attr]
    assert _block(md) == so.render(runs, target)
    # every committed run has its record, finished, of the experiment and the name it carries
    for (arm, lr, seed), rd in runs.items():
        assert rd.record is not None and rd.done, rd.name
        assert (rd.record["spec"]["arm"], rd.record["spec"]["server_lr"], rd.record["spec"]["seed"]) == (arm, lr, seed)
        assert len(rd.rows) == rd.record["spec"]["rounds"]
        steps = [r["metrics"].get("server_opt_step") for r in rd.rows]
        assert steps == ([None] * len(rd.rows) if arm == "fedavg" else [float(i + 1) for i in range(len(rd.rows))])
