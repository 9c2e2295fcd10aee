"""tools/bench/bench_grpc_floor.py and tools/bench/bench_rounds.py --idle: the arithmetic, and real (tiny) runs."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import bench_grpc_floor as floor

ROOT = Path(__file__).resolve().parents[2]
BENCH_ROUNDS = str(ROOT / "tools" / "bench" / "bench_rounds.py")


def test_per_call_us() -> None:
    assert floor.per_call_us(1.0, 1.5, 1000) == pytest.approx(500.0)
    with pytest.raises(ValueError):
        floor.per_call_us(1.0, 1.5, 0)


def test_cpu_seconds_of_this_process_grows() -> None:
    import os

    before = floor.cpu_seconds(os.getpid())
    x = 0
    for i in range(3_000_000):
        x += i
    assert floor.cpu_seconds(os.getpid()) > before


@pytest.mark.system
def test_wake_cost_measures_a_write_alone_and_a_wake_up_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    alone, waking = floor.wake_cost(200)
    # A wake-up is at least the write itself plus a thread switch each way; both are real CPU readings.
    assert 0.0 <= alone < waking
    with pytest.raises(ValueError, match="n must be >= 1"):
        floor.wake_cost(0)
    assert floor.main(["--calls", "0", "--wakes", "50"]) == 0
    assert "a wake-up round trip between two threads" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        floor.main(["--calls", "0", "--wakes", "0"])


def test_floor_benchmark_runs_every_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert floor.main(["--calls", "40", "--repeats", "1", "--procs", "1", "--concurrency", "4", "--params", "64"]) == 0
    out = capsys.readouterr().out
    for label in ("Heartbeat's shape", "PullTask's shape", "PushUpdate's shape", "one open stream",
                  "bare TCP connection (no gRPC)"):
        line = next(x for x in out.splitlines() if label in x)
        assert float(re.search(r"server CPU\s+([\d.]+) µs per call", line).group(1)) >= 0  # type: ignore[union-attr]
    assert "floor per client-round" in out and "served on the event loop's own thread" in out


def test_the_bare_tcp_shape_answers_each_update_with_a_task_of_its_size() -> None:
    """The bare shape's server: frames split across reads are reassembled; a header frame is not answered, a data
    frame is, with a header and a data frame of the same size."""
    sent: list[bytes] = []

    class Transport:
        def writelines(self, frames: list[bytes]) -> None:
            sent.extend(frames)

    proto = floor._BareSession()
    proto.connection_made(Transport())  # type: ignore[arg-type]
    wire = floor.frame(b"h" * floor.HEADER_BYTES) + floor.frame(bytes(300))
    for i in range(0, len(wire), 7):  # seven bytes at a time
        proto.data_received(wire[i:i + 7])
    assert sent == [floor.frame(b"h" * floor.HEADER_BYTES), floor.frame(bytes(300))] and not proto.buf


@pytest.mark.system
def test_bench_rounds_idle_reports_joins_idle_cpu_and_memory(tmp_path: Path) -> None:
    kept = tmp_path / "kept"
    proc = subprocess.run([sys.executable, BENCH_ROUNDS, "--clients", "4", "-k", "2",
                           "--virtual", "--procs", "1", "--rounds", "1", "--idle", "1", "--keep-logs", str(kept)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # Every client acknowledged the end with its Leave before the server stopped (none lost to the shutdown).
    assert re.search(r"^the end: 4 of 4 clients left after the last round; the server stopped [\d.]+ s after "
                     r"federation\.finished \(no client lost\)$", out, re.M), out
    assert (kept / "server.log").is_file() and (kept / "run" / "rounds.jsonl").is_file()
    assert sorted(p.name for p in kept.glob("clients-*.log")) == ["clients-0.log", "clients-1.log"]
    again = subprocess.run([sys.executable, BENCH_ROUNDS, "--keep-logs", str(kept)],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert again.returncode == 2 and "not empty" in again.stderr  # kept logs are never overwritten
    assert re.search(r"^3 clients joined in [\d.]+ s", out, re.M), out
    assert re.search(r"idle server with 3 clients connected .*: [\d.]+% of a core", out), out
    assert "client hosts' private memory" in out
    assert "K = 2 of N = 4 clients (threads of 2 process(es); a Session stream each)" in out  # + the held-back host
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"  # --event-loop auto
    assert f"server event loop: {loop}" in out, out


@pytest.mark.system
def test_bench_rounds_measures_the_unary_calls_on_request(tmp_path: Path) -> None:
    sums = tmp_path / "cpu.json"
    proc = subprocess.run([sys.executable, BENCH_ROUNDS, "-k", "2", "--rounds", "1",
                           "--transport", "unary", "--event-loop", "asyncio", "--cpu-breakdown", str(sums)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "K = 2 of N = 2 clients (one process each; unary PullTask/PushUpdate calls)" in proc.stdout, proc.stdout
    # The acceptances' spread comes from the rows' timing (update.accepted is a debug-level log line).
    m = re.search(r"^updates accepted after the round's start \(rounds\.jsonl; medians over rounds\): "
                  r"first ([\d.]+) s, median ([\d.]+) s, last ([\d.]+) s$", proc.stdout, re.M)
    assert m is not None and 0.0 < float(m[1]) <= float(m[2]) <= float(m[3]) + 1e-4, proc.stdout
    # The clients' CPU beside the server's: what a round costs the machine.
    line = (r"^client processes' CPU seconds per round \(all of them, same span\): [\d.]+ \([\d.]+ ms per "
            r"client-round\); with the server's: [\d.]+ ms of CPU per round on \d+ cores$")
    assert re.search(line, proc.stdout, re.M), proc.stdout
    # --cpu-breakdown: the server ran under tools/bench/cpu_breakdown.py; every update went through the timed
    # intake once.
    got = json.loads(sums.read_text())
    updates = 2 * 2  # K = 2, one warm-up round and one timed
    assert got["functions"]["UpdateIntake.submit"]["calls"] == updates, got
    assert 0 < got["functions"]["UpdateIntake.submit"]["cpu_ns"] < got["process_cpu_ns"], got
    assert {f"gc generation {g}" for g in range(3)} <= got["functions"].keys(), got  # the collector's passes
    # ... and each round's close: its aggregate, its row, once per round
    assert got["functions"]["StreamingFedAvg.finalize"]["calls"] == 2 == got["functions"]["write_round"]["calls"], got
    assert re.search(r"^  UpdateIntake\.submit +[\d.]+ +1\.00 +[\d.]+$", proc.stdout, re.M), proc.stdout
    # ... and the first client under it too: its two rounds, each evaluated once.
    client = json.loads((tmp_path / "cpu.client.json").read_text())
    assert client["functions"]["LocalRound.run"]["calls"] == 2 == client["functions"]["evaluate"]["calls"], client
    assert "client bench-0 CPU by function" in proc.stdout, proc.stdout
    assert "server event loop: asyncio" in proc.stdout, proc.stdout


@pytest.mark.system
def test_bench_rounds_measures_the_framed_port_under_mutual_tls(tmp_path: Path) -> None:
    sums = tmp_path / "cpu.json"
    proc = subprocess.run([sys.executable, BENCH_ROUNDS, "-k", "2", "--rounds", "1",
                           "--transport", "framed", "--tls", "--cpu-breakdown", str(sums)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(one process each; a Session stream each on the framed port)" in proc.stdout, proc.stdout
    # The first client's exchanges went over the framed connection (its replies read there: round 2's task and the
    # end, each the acknowledgement of the update sent with its pull), the server's frames through the framed port's
    # protocol: no fallback to gRPC.
    client = json.loads((tmp_path / "cpu.client.json").read_text())
    assert client["functions"]["FramedSession.reply"]["calls"] >= 2, client
    assert json.loads(sums.read_text())["functions"]["_Connection.data_received"]["calls"] >= 4


def _children(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


@pytest.mark.system
def test_bench_rounds_killed_kills_what_it_started() -> None:
    """SIGTERM to the benchmark (a timeout, a CI runner) while its rounds run kills its server and client processes
    instead of orphaning them."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, BENCH_ROUNDS, "-k", "2", "--rounds", "100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while len(kids := _children(proc.pid)) < 3:  # the server and both clients are running
            assert proc.poll() is None and time.monotonic() < deadline, "the benchmark did not start its processes"
            time.sleep(0.2)
        time.sleep(3)  # into the rounds
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert not [k for k in kids if Path(f"/proc/{k}").exists()], "processes left running"
    finally:
        if proc.poll() is None:
            proc.kill()
