"""tools/spy_profile.py: py-spy's raw samples summarized (no py-spy needed), and a clear error without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import spy_profile


def test_summary_shares_own_and_inclusive_and_the_event_loops_own_code(tmp_path: Path) -> None:
    raw = tmp_path / "spy.txt"
    loop = "<module> (fedserver/__main__.py:3);main (fedserver/cli.py:9);Runner.run (asyncio/runners.py:118)"
    raw.write_text("\n".join([
        f"{loop} 50",  # the loop's own C code: no Python frame under its run call
        f"{loop};FederationServicer.Session (fedserver/servicer.py:340);UpdateIntake.submit (fedserver/intake.py:1) 30",
        f"{loop};FederationServicer.Session (fedserver/servicer.py:351) 20",
        "not a sample line",
    ]) + "\n")
    lines = spy_profile.summarize(raw)
    assert lines[0].startswith("100 samples of the server holding the GIL") and lines[0].endswith(": 50.0%")
    rows = {line.split("  ", 2)[-1].strip(): line.split()[:2] for line in lines[2:]}
    assert rows["FederationServicer.Session (servicer.py)"] == ["20.0%", "50.0%"]
    assert rows["UpdateIntake.submit (intake.py)"] == ["30.0%", "30.0%"]
    assert not any(k.startswith(("Runner.run", "<module>", "main ")) for k in rows)  # the frames every sample has


def test_no_samples_and_no_py_spy_say_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert spy_profile.summarize(empty) == ["py-spy: no samples"]
    monkeypatch.setattr("tools.spy_profile.shutil.which", lambda name: None)
    with pytest.raises(SystemExit, match=r"py-spy is not installed \(pip install py-spy\)"):
        spy_profile.py_spy()
    assert spy_profile.Recorder(1, tmp_path / "never.txt").stop() == "py-spy never started (the timed rounds did " \
                                                                      "not begin)"
