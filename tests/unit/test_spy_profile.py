"""tools/bench/spy_profile.py: py-spy's raw samples summarized (no py-spy needed), and a clear error without it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.bench import spy_profile


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
    monkeypatch.setattr("tools.bench.spy_profile.shutil.which", lambda name: None)
    with pytest.raises(SystemExit, match=r"py-spy is not installed \(pip install py-spy\)"):
        spy_profile.py_spy()
    assert spy_profile.Recorder(1, tmp_path / "never.txt").stop() == "py-spy never started (the timed rounds did " \
                                                                      "not begin)"


def test_native_samples_name_the_libraries_the_system_calls_and_the_wake_ups(tmp_path: Path) -> None:
    """A ``--native`` sample's C frames under the loop's run call count as the loop's own C code; the innermost
    frame's library and the C library's calls are shared out, and a wake-up (eventfd_write) anywhere is counted."""
    root = "0x7f01 (libc.so.6);<module> (fedserver/__main__.py:3);Runner.run (asyncio/runners.py:118)"
    grpc = "0x7f99 (grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so)"
    raw = tmp_path / "native.txt"
    raw.write_text("\n".join([
        f"{root};{grpc};eventfd_write (libc.so.6);write (libc.so.6) 30",  # gRPC waking its poller thread
        f"{root};{grpc};sendmsg (libc.so.6) 10",
        f"{root};FederationServicer._update (fedserver/servicer.py:256);StreamingFedAvg.add "
        "(fedcore/aggregation/base.py:192);c10::impl::OperatorEntry::lookup (libtorch_cpu.so) 20",
        f"{root};FederationServicer.Session (fedserver/servicer.py:340);leave_task (_asynciomodule.c:1976) 15",
        f"{root};step (fedcore/rounds.py:10) 25",
    ]) + "\n")
    lines = spy_profile.summarize(raw)
    assert lines[0].startswith("100 samples of the server holding the GIL (100 Hz, native)")
    assert lines[0].endswith(": 40.0%")  # the gRPC samples: C under the run call, no Python frame
    rows = {line.split("  ", 2)[-1].strip(): line.split()[:2] for line in lines[2:]}
    assert rows["StreamingFedAvg.add (base.py)"] == ["20.0%", "20.0%"]  # the C under it is its own, as without --native
    assert rows["step (rounds.py)"] == ["25.0%", "25.0%"]
    libs = next(line for line in lines if line.startswith("innermost frame by library: "))
    assert libs == ("innermost frame by library: the C library (system calls, malloc) 40.0%, Python code 25.0%, "
                    "torch 20.0%, asyncio's C 15.0%")
    assert "  the C library's calls: write 30.0%, sendmsg 10.0%" in lines
    assert lines[-1].endswith("poller): 30.0%")
    assert spy_profile.library("0x7f (grpc/_cython/cygrpc.so)") == "gRPC (its core and Cython)"
    assert spy_profile.library("Py_DECREF (object.h:537)") == "the interpreter and other C"


def test_the_recorder_asks_py_spy_for_native_frames_only_when_told(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setattr("tools.bench.spy_profile.shutil.which", lambda name: "/usr/bin/py-spy")
    plain = spy_profile.Recorder(7, tmp_path / "a.txt").command()
    native = spy_profile.Recorder(7, tmp_path / "b.txt", native=True).command()
    assert "--native" not in plain and plain[plain.index("-r") + 1] == str(spy_profile.RATE_HZ)
    assert "--native" in native and native[native.index("-r") + 1] == str(spy_profile.NATIVE_RATE_HZ)
    assert "--gil" in plain and "--gil" in native
