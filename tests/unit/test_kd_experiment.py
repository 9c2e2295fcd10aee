"""The HYDRA-FL experiment driver's plan and summary (tools/experiments/kd_experiment.py), without running
federations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.experiments.kd_experiment import main, plan


def test_the_plan_pairs_every_arm_with_and_without_its_papers_attack() -> None:
    runs = dict(plan("ntd", ["fedavg", "fedntd", "hydra"]))
    assert sorted(runs) == ["ntd-fedavg-dyn_opt", "ntd-fedavg-none", "ntd-fedntd-dyn_opt", "ntd-fedntd-none",
                            "ntd-hydra-dyn_opt", "ntd-hydra-none"]
    assert "--attack" not in runs["ntd-fedntd-none"]
    attacked = runs["ntd-hydra-dyn_opt"]
    assert attacked[attacked.index("--attack") + 1] == "dyn_opt" and "--knowledge" in attacked
    assert 'recovery.method="hydra"' in attacked
    assert all("stat_opt" in n or "none" in n for n in dict(plan("moon", ["moon", "hydra_moon"])))
    rules = dict(plan("rules", ["fedavg"]))
    assert len(rules) == 11 and 'aggregation.rule="krum"' in rules["rules-krum-dyn_opt"]
    partial = rules["rules-trimmed_mean-dyn_opt_partial"]
    assert partial[partial.index("--attack") + 1] == "dyn_opt"
    assert partial[partial.index("--knowledge") + 1] == "partial"


def test_summarize_reports_the_drop_under_attack(tmp_path: Path, capsys: object) -> None:
    for name, acc in (("ntd-fedavg-none-s0", 0.9), ("ntd-fedavg-dyn_opt-s0", 0.6)):
        d = tmp_path / name
        d.mkdir()
        rows = [{"round": r, "outcome": "quorum", "central_accuracy": acc, "attackers": 2, "seconds": 1.0,
                 "metrics": {"harness_crafted": 2.0, "harness_gamma": 10.0}} for r in range(1, 6)]
        (d / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md = tmp_path / "out.md"
    assert main(["summarize", str(tmp_path), "--md", str(md)]) == 0
    text = md.read_text()
    assert "| ntd-fedavg-dyn_opt (s0) | 0.900 | 0.600 | 0.300 | 92.12 -> 74.48 |" in text
    assert "ntd-fedavg-none-s0 (stopped)" in text  # no final model: not finished
    png = tmp_path / "plots" / "acc.png"
    assert main(["summarize", str(tmp_path), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dyn_opt_direction_other_than_std_names_its_runs_and_sets_the_option() -> None:
    runs = dict(plan("ntd", ["fedavg"], "unit"))
    assert sorted(runs) == ["ntd-fedavg-dyn_opt_unit", "ntd-fedavg-none"]
    attacked = runs["ntd-fedavg-dyn_opt_unit"]
    assert attacked[attacked.index("--attack-set") + 1] == "dev_type=unit"
    assert "--attack-set" not in runs["ntd-fedavg-none"]
    moon = dict(plan("moon", ["moon"], "unit"))  # Stat-Opt has no direction: names and arguments unchanged
    assert "moon-moon-stat_opt" in moon and "--attack-set" not in moon["moon-moon-stat_opt"]
    rules = dict(plan("rules", ["fedavg"], "unit"))
    assert "rules-krum-dyn_opt_unit" in rules and "rules-trimmed_mean-dyn_opt_partial_unit" in rules


def test_summarize_reads_kept_round_files_and_only_filters(tmp_path: Path) -> None:
    """docs/results/hydra_acceptance/ keeps <run>.rounds.jsonl files: summarize reads them as finished runs."""
    for name, acc in (("ntd-hydra_s2-none-s1", 0.8), ("ntd-hydra_s2-dyn_opt_unit-s1", 0.5), ("moon-moon-none-s0", 0.7)):
        rows = [{"round": r, "outcome": "quorum", "central_accuracy": acc if r > 1 else 0.0, "attackers": 0,
                 "seconds": 1.0, "metrics": {}} for r in range(1, 7)]
        (tmp_path / f"{name}.rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "notes.txt").write_text("not a run")
    md = tmp_path / "out.md"
    assert main(["summarize", str(tmp_path), "--only", "ntd-", "--md", str(md)]) == 0
    text = md.read_text()
    # the last 5 rounds (round 1's 0.0 left out); the drop; the paper's figure for the S2 arm; no "(stopped)"
    assert "| ntd-hydra_s2-dyn_opt_unit (s1) | 0.800 | 0.500 | 0.300 | 92.69 -> 76.67 |" in text
    assert "| ntd-hydra_s2-none-s1 | 6 | 0.800 | 0.800 |" in text
    assert "moon-moon" not in text and "stopped" not in text


def test_a_tagged_attack_setting_names_the_attacked_runs_and_reaches_only_them() -> None:
    """Attack calibration (issue 49): --attack-set gamma_init=1.0 --tag g1 runs the attacked arms as
    ``<attack>_g1`` with the option; the no-attack runs keep their names and arguments (they are the same runs)."""
    runs = dict(plan("ntd", ["fedavg"], "unit", "g1", ["gamma_init=1.0"]))
    assert sorted(runs) == ["ntd-fedavg-dyn_opt_unit_g1", "ntd-fedavg-none"]
    attacked = runs["ntd-fedavg-dyn_opt_unit_g1"]
    sets = [attacked[i + 1] for i, a in enumerate(attacked) if a == "--attack-set"]
    assert sets == ["dev_type=unit", "gamma_init=1.0"]
    assert runs["ntd-fedavg-none"] == dict(plan("ntd", ["fedavg"], "unit"))["ntd-fedavg-none"]
    for bad in ((["gamma_init=1.0"], ""), ([], "G-1")):
        try:
            plan("ntd", ["fedavg"], "unit", bad[1], bad[0])
        except ValueError as err:
            assert "--tag" in str(err)
        else:
            raise AssertionError(f"plan accepted {bad}")


DAMAGE_HEADER = ("| attacked run | rounds used | attackers/round | damage (points per attacker) | "
                 "carry-over (points per attacker) |")


def _before_damage(lines: list[str]) -> list[str]:
    """summarize's lines before its damage table (whose rows also start with the run's name)."""
    return lines[:lines.index(DAMAGE_HEADER)] if DAMAGE_HEADER in lines else lines


def test_the_committed_calibration_runs_give_the_table_the_page_quotes(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/results/hydra_epochs5.md's calibration table, recomputed from the committed rows (issue 49 item 3)."""
    root = Path(__file__).resolve().parents[2]
    assert main(["summarize", str(root / "docs" / "results" / "hydra_epochs5" / "calibration")]) == 0
    lines = _before_damage(capsys.readouterr().out.splitlines())
    runs = {c[0]: c for c in ([x.strip() for x in line.strip().strip("|").split("|")] for line in lines
                              if line.startswith("| ntd-") and "(s9)" not in line)}
    drops = {c[0]: c for c in ([x.strip() for x in line.strip().strip("|").split("|")] for line in lines
                               if line.startswith("| ntd-") and "(s9)" in line)}
    page = (root / "docs" / "results" / "hydra_epochs5.md").read_text()
    assert all(c[1] == "12" for c in runs.values()) and len(runs) == 4
    assert f"| no attack | ntd-fedavg-none-s9 | {runs['ntd-fedavg-none-s9'][3]} | - | - |" in page
    for label, run in (("0.5 (1)", "ntd-fedavg-dyn_opt_unit_g05-s9"), ("2 (4)", "ntd-fedavg-dyn_opt_unit_g2-s9"),
                       ("10 (20, the default)", "ntd-fedavg-dyn_opt_unit-s9")):
        drop = 100 * float(drops[f"{run.removesuffix('-s9')} (s9)"][3])  # the drop table's, in points
        assert f"| {label} | {run} | {runs[run][3]} | {drop:.1f} | {runs[run][6]} |" in page, (label, runs[run])


def test_the_committed_grid_runs_give_the_rows_the_page_quotes(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    assert main(["summarize", str(root / "docs" / "results" / "hydra_epochs5")]) == 0
    page = (root / "docs" / "results" / "hydra_epochs5.md").read_text()
    out = _before_damage(capsys.readouterr().out.splitlines())
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in out
            if line.startswith("| ntd-") and "(s" not in line]
    assert rows
    for c in rows:
        gamma = "-" if c[6] == "-" else c[6]
        assert f"| {c[0]} | {c[1]} | {c[2]} | {c[3]} | {gamma} |" in page, c
    directions = [line for line in out if line.startswith("| ntd (")]
    assert directions and all(line in page for line in directions), directions  # the verdicts' figures


def test_summarize_states_the_t1_directions_where_a_seed_has_all_six_runs(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    accs = {"fedavg": (0.90, 0.70), "fedntd": (0.92, 0.60), "hydra": (0.91, 0.75)}
    for arm, (clean, attacked) in accs.items():
        for label, acc in (("none", clean), ("dyn_opt_unit_g2", attacked)):
            rows = [{"round": r, "outcome": "quorum", "central_accuracy": acc, "metrics": {}} for r in range(1, 6)]
            (tmp_path / f"ntd-{arm}-{label}-s3.rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "ntd-fedavg-none-s4.rounds.jsonl").write_text(  # seed 4 has one run: no directions for it
        json.dumps({"round": 1, "outcome": "quorum", "central_accuracy": 0.5, "metrics": {}}) + "\n")
    assert main(["summarize", str(tmp_path)]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("| ntd (")]
    # FedAvg drops 20 points, FedNTD 32 (12 more: amplified); HYDRA-FL keeps 15 more than FedNTD under attack and
    # costs 1 point without it. The paper's: 17.3 more, 18.6 kept, -0.3 point.
    assert lines == ["| ntd (s3, dyn_opt_unit_g2) | 20.0 | 32.0 | +12.0 | +15.0 | -1.0 | +17.3 / +18.6 / -0.3 |"]


def test_attack_damage_is_the_loss_per_attacker_in_the_round_and_the_next() -> None:
    """A run whose round loses 2 points per attacker and heals 1.5 of them the next round: damage +2, carry-over -1.5,
    measured on the second half only (the first half's rounds would give another slope)."""
    from tools.experiments.kd_experiment import attack_damage

    attackers = [0, 3, 0, 3, 1, 0, 2, 4, 1, 3, 0, 2, 1, 4, 0, 2, 3, 1, 0, 2]
    acc, rows = 50.0, []
    for i, k in enumerate(attackers):
        previous = attackers[i - 1] if i else 0
        acc += -2.0 * k + 1.5 * previous if i >= 10 else 5.0 * k  # the first half climbs with the attackers
        rows.append({"round": i + 1, "outcome": "quorum", "attackers": k, "central_accuracy": acc / 100})
    used, damage, carry = attack_damage(rows)
    assert used == 10
    # exact linear data: the fit is exact up to float rounding of values near 50 points (~1e-13)
    assert damage[0] == pytest.approx(2.0, abs=1e-9) and damage[1] == pytest.approx(0.0, abs=1e-6)
    assert carry[0] == pytest.approx(-1.5, abs=1e-9)


def test_the_page_quotes_the_damage_rows_summarize_prints(capsys: pytest.CaptureFixture[str]) -> None:
    root = Path(__file__).resolve().parents[2]
    assert main(["summarize", str(root / "docs" / "results" / "hydra_epochs5")]) == 0
    page = (root / "docs" / "results" / "hydra_epochs5.md").read_text()
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out[len(_before_damage(out)):] if line.startswith("| ntd-")]
    assert rows and all(line in page for line in rows), [line for line in rows if line not in page]
