"""The campaign runner (tools/runs.py, tools/experiments/nfl_experiment.py): which runs it skips, resumes or refuses,
the
record it keeps beside each rounds.jsonl, summaries of a partial campaign, collecting runs for committing, and
the committed tables recomputed from their committed per-round files. No federation is started: the launcher
command is replaced by a small Python program where a process is needed."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from tools import runs
from tools.experiments import nfl_experiment as nx
from tools.experiments import nfl_guard
from tools.runs import RECORD, RunDirError, finished, read_record, run_state, start_run

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"experiment": "nfl", "env": "nfl", "arm": "detect", "seed": 0, "rounds": 150}


def _args(out: Path, **kw: Any) -> argparse.Namespace:
    base = {"out": str(out), "seeds": [0], "envs": ["nfl"], "arms": ["fedavg"], "parallel": 1, "procs": 1,
            "rounds": 0, "private_epochs": None, "nr": None, "c": None, "timeout": 0.0, "until": "", "device": "",
            "sampling_timeout": 3600.0}
    return argparse.Namespace(**{**base, **kw})


def _rows(n: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"round": r, "test_accuracy_benign": 0.5, "beta_benign": 0.1, "central_accuracy": 0.6,
             "client_seconds": 1.0, "client_passes": 1.0, "nfl": "watching", **fields} for r in range(1, n + 1)]


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _finish(run_dir: Path) -> None:
    """Make ``run_dir`` look like a federation its server completed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "final_model.fgt").write_bytes(b"x")
    (run_dir / "server.log").write_text(json.dumps({"event": "federation.finished", "outcome": "completed"}) + "\n")


def _record(run_dir: Path, spec: dict[str, Any], **kw: Any) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    rec = {"name": run_dir.name, "spec": spec, "seed": spec.get("seed"), "target_rounds": spec.get("rounds"),
           "sittings": [], "rounds": 0, "finished": False, "wall_s": 0.0, **kw}
    (run_dir / RECORD).write_text(json.dumps(rec))


# ---- skip / resume / refuse ----

def test_a_missing_or_empty_directory_is_a_new_run(tmp_path: Path) -> None:
    assert run_state(tmp_path / "absent", SPEC) == "new"
    (tmp_path / "empty").mkdir()
    assert run_state(tmp_path / "empty", SPEC) == "new"


def test_a_finished_run_is_skipped_whoever_wrote_it(tmp_path: Path) -> None:
    _finish(tmp_path / "old")
    assert finished(tmp_path / "old") and run_state(tmp_path / "old", SPEC) == "finished"
    _finish(tmp_path / "mine")
    _record(tmp_path / "mine", SPEC)
    assert run_state(tmp_path / "mine", SPEC) == "finished"


def test_a_stalled_federation_is_not_finished(tmp_path: Path) -> None:
    d = tmp_path / "stalled"
    _finish(d)
    (d / "server.log").write_text(json.dumps({"event": "federation.finished", "outcome": "stalled"}) + "\n")
    _record(d, SPEC)
    assert not finished(d) and run_state(d, SPEC) == "resume"


def test_the_runners_own_unfinished_run_is_resumed(tmp_path: Path) -> None:
    d = tmp_path / "nfl-detect-s0"
    _record(d, SPEC)
    (d / "state").mkdir()
    assert run_state(d, SPEC) == "resume"


@pytest.mark.parametrize("setup", ["foreign", "unreadable", "not_a_record", "other_spec", "finished_other_spec"])
def test_a_directory_the_runner_did_not_write_is_refused_and_left_alone(tmp_path: Path, setup: str) -> None:
    d = tmp_path / "nfl-detect-s0"
    d.mkdir()
    (d / "rounds.jsonl").write_text('{"round": 1}\n')
    if setup == "unreadable":
        (d / RECORD).write_text("{not json")
    elif setup == "not_a_record":
        (d / RECORD).write_text("[1, 2]")
    elif setup == "other_spec":
        _record(d, {**SPEC, "rounds": 40})
    elif setup == "finished_other_spec":
        _record(d, {**SPEC, "seed": 1})
        _finish(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(RunDirError, match="nothing was changed"):
        run_state(d, SPEC)
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


def test_run_refuses_before_starting_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    foreign = tmp_path / "nfl-detect-s0"
    foreign.mkdir()
    (foreign / "server.log").write_text("someone else's\n")

    def no_start(*a: Any, **k: Any) -> Any:
        raise AssertionError("nothing may start")

    monkeypatch.setattr(runs, "start_run", no_start)
    assert nx.main(["run", "--out", str(tmp_path), "--envs", "nfl", "--arms", "fedavg", "detect",
                    "--seeds", "0"]) == 2
    assert "not written by this runner" in capsys.readouterr().err
    assert not (tmp_path / "nfl-fedavg-s0").exists()
    assert (foreign / "server.log").read_text() == "someone else's\n"


def test_run_skips_finished_runs_and_orders_rows_before_seeds(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    args = _args(tmp_path, seeds=[0, 1], envs=["nfl", "ideal"], arms=["fedavg", "detect"])
    assert nx.plan(args)[:3] == [("nfl", "fedavg", 0), ("nfl", "fedavg", 1), ("nfl", "detect", 0)]
    for e, a, s in nx.plan(args):
        d = tmp_path / f"{e}-{a}-s{s}"
        _finish(d)
        _record(d, nx.run_spec(e, a, s, args))
    monkeypatch.setattr(runs, "start_run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("started")))
    assert nx.run(args) == 0


def test_the_spec_takes_the_configs_scale(tmp_path: Path) -> None:
    spec = nx.run_spec("nfl", "detect", 2, _args(tmp_path))
    assert (spec["rounds"], spec["nr"], spec["c"], spec["private_epochs"]) == (150, 20, 20, 20)
    cmd = nx._launch_cmd("ideal", "holdouts", 1, _args(tmp_path, nr=5), tmp_path / "x")
    assert "nfl.nr=5" in cmd and "nfl.c=20" in cmd and cmd[cmd.index("--rounds") + 1] == "150"
    assert "--holdouts" in cmd and "--resume" not in cmd


# ---- the record ----

FAKE = ("import json, pathlib, sys; d = pathlib.Path(sys.argv[1]); p = d / 'rounds.jsonl'; "
        "n = len(p.read_text().splitlines()) if p.exists() else 0; "
        "p.open('a').write(json.dumps({'round': n + 1}) + '\\n'); print('resume' if '--resume' in sys.argv else 'new')")


def test_every_sitting_is_recorded_and_a_second_one_resumes(tmp_path: Path) -> None:
    d = tmp_path / "nfl-detect-s0"
    cmd = [sys.executable, "-c", FAKE, str(d)]
    info = {"fedguard_commit": "abc", "torch": "x"}
    for _ in range(2):
        assert run_state(d, SPEC) in ("new", "resume")
        r = start_run(d.name, cmd, d, SPEC, 150, info)
        assert r.close() == 0
    rec = read_record(d)
    assert rec is not None and rec["spec"] == SPEC and rec["seed"] == 0 and rec["target_rounds"] == 150
    first, second = rec["sittings"]
    assert not first["resumed"] and "--resume" not in first["command"]
    assert second["resumed"] and second["command"][-1] == "--resume"
    assert (first["rounds_before"], first["rounds_after"], second["rounds_before"], second["rounds_after"]) == (
        0, 1, 1, 2)
    assert second["fedguard_commit"] == "abc" and first["exit"] == 0 and first["ended_utc"]
    assert rec["rounds"] == 2 and rec["finished"] is False
    assert rec["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"], abs=0.2)
    log = (d / "launch.txt").read_text()
    assert log.count("# 20") == 2 and "new" in log and "resume" in log  # appended, never overwritten


def test_versions_name_the_code_the_children_import() -> None:
    from tools.runs import versions

    v = versions()
    assert re.fullmatch(r"[0-9a-f]{40}", v["fedguard_commit"])
    assert v["child_imports_fedserver_from"].startswith(v["fedguard_root"])
    assert v["python"] and v["torch"]


# ---- summaries of a partial campaign ----

def test_summarize_marks_unfinished_runs_and_averages_the_last_10_rounds(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    for seed, n in ((0, 30), (1, 12)):
        d = tmp_path / f"nfl-detect-s{seed}"
        _record(d, {**SPEC, "seed": seed}, wall_s=120.0,
                sittings=[{"resumed": False, "rounds_before": 0, "fedguard_commit": "a" * 40, "wall_s": 60.0},
                          {"resumed": True, "rounds_before": 5, "fedguard_commit": "a" * 40, "wall_s": 60.0}])
        # |beta_hat - beta| is 1.0 before the last 10 rounds and 0.1 in them
        _write_rows(d / "rounds.jsonl", [{**r, "beta_hat_error": 1.0 if r["round"] <= n - 10 else 0.1,
                                          "nfl": "reported" if r["round"] > 3 else "watching"} for r in _rows(n)])
    _finish(tmp_path / "nfl-detect-s0")
    md = tmp_path / "t.md"
    assert nx.main(["summarize", str(tmp_path), "--runs", "--md", str(md)]) == 0
    text = md.read_text()
    assert "| nfl | detect | benign | 0/1 | 30/12* | 0.600 | 0.500 | 0.100 | 0.100 | 4/4 | -/- | - | 1.00x |" \
        in text
    assert "`*` unfinished run (rounds reached, of 150 asked)" in text
    assert "| nfl-detect-s1 | 12/150 | unfinished | 2.0 | 2 | 5 | cpu | aaaaaaaaaa |" in text
    assert "| nfl-detect-s0 | 30/150 | finished |" in text


def test_summarize_reads_collected_files_and_refuses_two_of_one_run(tmp_path: Path) -> None:
    _write_rows(tmp_path / "nfl-fedavg-s0.rounds.jsonl", _rows(12))
    _write_rows(tmp_path / "reduced-nfl-fedavg-s1.rounds.jsonl", _rows(12))
    runs = nx.load_runs([str(tmp_path)])
    assert sorted(runs) == [("nfl", "fedavg", 0), ("nfl", "fedavg", 1)]
    assert runs[("nfl", "fedavg", 0)].done is None  # no record: unknown, not marked
    _write_rows(tmp_path / "other-nfl-fedavg-s0.rounds.jsonl", _rows(3))
    with pytest.raises(SystemExit, match="two runs"):
        nx.load_runs([str(tmp_path)])


def test_collect_copies_finished_runs_and_never_another_runs_rows_over_a_collected_file(
        tmp_path: Path) -> None:
    out, dest = tmp_path / "out", tmp_path / "dest"
    for name, n in (("nfl-fedavg-s0", 150), ("nfl-detect-s0", 40)):
        _record(out / name, {**SPEC, "arm": name.split("-")[1]})
        _write_rows(out / name / "rounds.jsonl", _rows(n))
    _finish(out / "nfl-fedavg-s0")
    assert nx.main(["collect", str(out), str(dest)]) == 0
    assert not dest.exists() or not any(dest.iterdir())  # its sitting is not over: not collected yet
    _record(out / "nfl-fedavg-s0", {**SPEC, "arm": "fedavg"}, sittings=[{"ended_utc": "2026-11-25T03:00:00+00:00"}])
    assert nx.main(["collect", str(out), str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["nfl-fedavg-s0.record.json", "nfl-fedavg-s0.rounds.jsonl"]
    rec = read_record(dest / "nfl-fedavg-s0.record.json")
    assert rec is not None and rec["finished"] is True and rec["rounds"] == 150
    assert nx.main(["collect", str(out), str(dest), "--partial"]) == 0
    rec = read_record(dest / "nfl-detect-s0.record.json")
    assert rec is not None and rec["finished"] is False
    runs = nx.load_runs([str(dest)])
    assert runs[("nfl", "detect", 0)].reached() == "40*"
    _write_rows(dest / "nfl-detect-s0.rounds.jsonl", _rows(2, test_accuracy_benign=0.9))  # not a prefix
    assert nx.main(["collect", str(out), str(dest), "--partial"]) == 0
    assert len((dest / "nfl-detect-s0.rounds.jsonl").read_text().splitlines()) == 2  # left as it was


# ---- the committed tables, recomputed from the committed per-round files ----

def _md_rows(md: Path, head: str) -> list[str]:
    """The rows of the first Markdown table under a line starting with ``head``."""
    lines = md.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    table = []
    for line in lines[start + 1:]:
        if line.startswith("| env |") or line.startswith("| --- |"):
            continue
        if line.startswith("| "):
            table.append(line)
        elif table:
            break
    return table


def _summary(paths: list[Path]) -> list[str]:
    runs = nx.load_runs([str(p) for p in paths])
    return ["| " + " | ".join(r) + " |" for r in nx.summary_rows(runs)]


def test_the_reduced_scale_table_is_recomputed_from_its_committed_rows() -> None:
    res = ROOT / "docs" / "results"
    paths = sorted((res / "recovery_methods").glob("*-fedavg-s?.rounds.jsonl")) + sorted(
        (res / "recovery_methods").glob("*-detect-s?.rounds.jsonl")) + sorted(
        (res / "nfl_acceptance").glob("reduced-*.rounds.jsonl"))
    committed = _md_rows(res / "nfl_acceptance.md", "## All four rows")
    assert len(committed) == 10
    assert committed == _summary(paths)


def test_the_recovery_methods_table_is_recomputed_from_its_committed_rows() -> None:
    """Including its abs(beta_hat - beta) column, over the last 10 rounds as its header says (issue 28)."""
    res = ROOT / "docs" / "results"
    committed = _md_rows(res / "recovery_methods.md", "<!-- summarize: begin -->")
    assert len(committed) == 16
    assert committed == _summary([res / "recovery_methods"])
    head = next(line for line in (res / "recovery_methods.md").read_text().splitlines() if line.startswith("| env |"))
    assert "abs(beta_hat - beta), last 10" in head


def test_the_paper_scale_table_is_recomputed_from_its_committed_rows() -> None:
    res = ROOT / "docs" / "results"
    if not (res / "nfl_paper.md").exists() or not any((res / "nfl_paper").glob("*.rounds.jsonl")):
        pytest.skip("no paper-scale runs committed yet")
    committed = _md_rows(res / "nfl_paper.md", "## The table")
    assert committed and committed == _summary([res / "nfl_paper"])
    # LINDT's comparison: seed 0 of every NFL-environment arm
    seed0 = sorted((res / "nfl_paper").glob("nfl-*-s0.rounds.jsonl"))
    committed = _md_rows(res / "nfl_paper.md", "## LINDT's comparison")
    assert committed and committed == _summary(seed0)


def test_the_sequential_drivers_skip_resume_and_refuse_through_launch_run(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """tools/experiments/distfl_experiment.py and tools/experiments/kd_experiment.py start their runs with
    launch_run."""

    monkeypatch.setattr(runs, "versions", lambda: {"fedguard_commit": "abc"})
    d = tmp_path / "mnist-flip-distfl-s0"
    cmd = [sys.executable, "-c", FAKE, str(d)]
    assert runs.launch_run(cmd, d, 0.0, target_rounds=30) == 0
    assert runs.launch_run(cmd, d, 0.0, target_rounds=30) == 0
    rec = read_record(d)
    assert rec is not None and [s["resumed"] for s in rec["sittings"]] == [False, True]
    assert rec["spec"] == {"command": cmd[1:]} and rec["target_rounds"] == 30
    _finish(d)
    assert runs.launch_run(cmd, d, 0.0) == 0  # finished: skipped
    assert len(read_record(d)["sittings"]) == 2  # type: ignore[index]
    foreign = tmp_path / "kd-s0"
    foreign.mkdir()
    (foreign / "server.log").write_text("x")
    with pytest.raises(RunDirError):
        runs.launch_run([sys.executable, "-c", FAKE, str(foreign)], foreign, 0.0)
    assert sorted(p.name for p in foreign.iterdir()) == ["server.log"]


def test_summarize_into_replaces_only_the_marked_block(tmp_path: Path) -> None:
    _write_rows(tmp_path / "nfl-fedavg-s0.rounds.jsonl", _rows(12))
    md = tmp_path / "doc.md"
    md.write_text(f"# title\n\nhand-written\n\n{nx.BEGIN}\nold table\n{nx.END}\n\nmore text\n")
    assert nx.main(["summarize", str(tmp_path / "nfl-fedavg-s0.rounds.jsonl"), "--into", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("# title\n\nhand-written\n\n") and text.endswith(f"{nx.END}\n\nmore text\n")
    assert "old table" not in text and "| nfl | fedavg | benign | 0 | 12 |" in text
    md.write_text(f"{nx.BEGIN}\n{nx.END}\n<!-- summarize s0: begin -->\nx\n<!-- summarize s0: end -->\n")
    assert nx.main(["summarize", str(tmp_path), "--into", str(md), "--block", "s0"]) == 0
    assert md.read_text().startswith(f"{nx.BEGIN}\n{nx.END}\n<!-- summarize s0: begin -->\n| env |")
    md.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs one"):
        nx.main(["summarize", str(tmp_path), "--into", str(md)])


def test_the_cifar10_table_and_the_replay_agreement_are_recomputed_from_their_committed_rows() -> None:
    """docs/results/nfl_paper_cifar.md (issue 49): the table, and each live detect run's report round against the
    replay of the same seed's FedAvg run (within 2 rounds), from the committed per-round files."""
    res = ROOT / "docs" / "results"
    runs = res / "nfl_paper_cifar"
    if not (res / "nfl_paper_cifar.md").exists() or not any(runs.glob("*.rounds.jsonl")):
        pytest.skip("no CIFAR-10 paper-scale runs committed yet")
    committed = _md_rows(res / "nfl_paper_cifar.md", "## The table")
    assert committed and committed == _summary([runs])
    doc = (res / "nfl_paper_cifar.md").read_text()
    rows = nfl_guard.agreement(nfl_guard.load_runs([str(runs)]))
    table = nfl_guard.agreement_table(rows)
    assert table in doc
    assert all(a.agrees for a in rows), table
