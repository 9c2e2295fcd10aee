"""Framework overhead per round: fedserver + K fedclient processes on loopback with a no-op trainer.

Clients return the received model at once, so what is left is the protocol: long-poll hand-out of the
model in chunks, upload stream, validation, FedAvg, state-machine steps, logging. Reports the median
server-side seconds per round (round start -> aggregated), the wall-clock seconds between consecutive
round completions, and the peak RSS (ru_maxrss from wait4) of the server and of each client process.

    python tools/bench_rounds.py                     # K = 10, 20 timed rounds, synthetic MLP
    python tools/bench_rounds.py --hidden 1024 512   # a ~0.6M-parameter MLP instead
    python tools/bench_rounds.py --virtual           # the K clients as threads of one process
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from tempfile import TemporaryDirectory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait4(p: subprocess.Popen[bytes], timeout: float) -> tuple[int, float]:
    """Exit code and peak RSS in MiB of one child process."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status, usage = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            p.returncode = os.waitstatus_to_exitcode(status)
            return p.returncode, usage.ru_maxrss / 1024.0
        if time.monotonic() > deadline:
            p.kill()
            raise TimeoutError(f"process {p.args!r} did not finish")
        time.sleep(0.02)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds (one warm-up round is added)")
    ap.add_argument("--hidden", type=int, nargs="*", default=[64], help="MLP hidden widths")
    ap.add_argument("--virtual", action="store_true", help="clients as threads of one process")
    args = ap.parse_args()
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    with TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        address = f"127.0.0.1:{_free_port()}"
        total = args.rounds + 1
        server = subprocess.Popen(
            [py, "-m", "fedserver", "--address", address, "--rounds", str(total), "-k", str(args.k),
             "--run-dir", str(run_dir), "--log-json", "--log-level", "info", "--linger", "0.5",
             "--model-kwargs", json.dumps({"hidden": args.hidden})],
            stdout=open(Path(tmp) / "server.log", "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
        if args.virtual:
            cmds = [[py, "-m", "tools.launch", "worker", "--server", address, "--first", "0", "--count",
                     str(args.k), "--trainer", "noop"]]
        else:
            cmds = [[py, "-m", "fedclient", "--server", address, "--client-id", f"bench-{i}", "--data-index",
                     str(i), "--trainer", "noop", "--torch-threads", "1", "--log-level", "warning"]
                    for i in range(args.k)]
        clients = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for c in cmds]
        rc, server_rss = _wait4(server, 600)
        client_res = [_wait4(c, 60) for c in clients]
        events = [json.loads(line) for line in (Path(tmp) / "server.log").read_text().splitlines()
                  if line.startswith("{")]
    if rc != 0 or any(code != 0 for code, _ in client_res):
        print(f"benchmark run failed: server {rc}, clients {[c for c, _ in client_res]}", file=sys.stderr)
        return 1
    done = [e for e in events if e["event"] == "round.completed"]
    assert len(done) == total, len(done)
    timed = done[1:]
    per_round = [e["seconds"] for e in timed]
    stamps = [datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() for e in done]
    wall = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    start = next(e for e in events if e["event"] == "federation.started")
    rss = [r for _, r in client_res]
    print(f"K = {args.k} clients ({'threads of one process' if args.virtual else 'one process each'}), "
          f"no-op trainer, {start['params']:,}-parameter MLP, {args.rounds} timed rounds after 1 warm-up")
    print(f"median seconds per round (start -> aggregated): {statistics.median(per_round):.4f}  "
          f"(min {min(per_round):.4f}, max {max(per_round):.4f})")
    print(f"wall seconds per round (between completions):   {wall:.4f}")
    print(f"peak RSS server: {server_rss:.0f} MiB; client process: median {statistics.median(rss):.0f} MiB, "
          f"max {max(rss):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
