"""What an idle federation costs: server and client-host CPU with N connected virtual clients and no round.

A ``fedserver`` subprocess (plaintext, mlp on synthetic data, K larger than the fleet so no round ever starts,
sampling timeout an hour) and ``--procs`` worker processes of ``fedlaunch`` hosting ``--clients`` virtual
FedClients between them (as ``fedguard-launch --virtual`` runs them: a host's clients share one channel, each
parked in its long-poll). Once the server counts every client alive (GetStatus with the operator credential) and
a settling time has passed, the CPU seconds (user + system, /proc/PID/stat) of the server and of all the worker
processes together are sampled over ``--window`` seconds: the figure is the percentage of one core. An idle client
re-polls once per long-poll (``server.long_poll_s``, 60 s), so a window shorter than that may or may not hold a
client's re-poll: ``--window 120`` averages over two. Also counted: the ``security.insecure`` warnings in the
workers' logs (one per process expected, not one per virtual client), and the threads of the workers
(``/proc/PID/status``).

    python tools/bench/bench_idle.py                         # 1,000 clients in 4 worker processes, 30 s window
    python tools/bench/bench_idle.py --clients 200 --procs 2 --window 20
    python tools/bench/bench_idle.py --window 120            # two long-polls: each client's re-polls averaged in
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=4, help="worker processes hosting the virtual clients")
    ap.add_argument("--window", type=float, default=30.0, help="seconds of CPU sampling")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after the last join before sampling")
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import grpc

    from fedguard.v1 import fedguard_pb2 as pb
    from fedlaunch.hosts import HostSpec, worker_command

    operator = secrets.token_urlsafe(18)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    n = args.clients
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t = Path(tmp)
        address = f"127.0.0.1:{_free_port()}"
        server = subprocess.Popen(
            [sys.executable, "-m", "fedserver", "--address", address, "--run-dir", str(t / "run"), "--insecure",
             "--rounds", "1", "-k", str(10 * n), "--model", "mlp", "--dataset", "synthetic",
             "--set", "rounds.sampling_timeout_s=3600", "--log-level", "warning"],
            stdout=open(t / "server.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**env, "FEDGUARD_OPERATOR_TOKEN": operator})
        per = -(-n // args.procs)
        cmds = [worker_command(HostSpec(address, first, min(per, n - first), trainer="noop"),
                               t / f"host-{first}.json") for first in range(0, n, per)]
        logs = [t / f"worker-{i}.log" for i in range(len(cmds))]
        workers = [subprocess.Popen(c, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)  # noqa: SIM115
                   for c, log in zip(cmds, logs, strict=True)]
        try:
            channel = grpc.insecure_channel(address)
            status = channel.unary_unary("/fedguard.v1.Federation/GetStatus", pb.StatusRequest.SerializeToString,
                                         pb.StatusReply.FromString)
            deadline = time.monotonic() + 600
            alive = 0
            while alive < n:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit(f"only {alive} of {n} clients connected:\n"
                                     + (t / "server.log").read_text()[-2000:])
                with contextlib.suppress(grpc.RpcError):
                    alive = status(pb.StatusRequest(), timeout=5, metadata=(("fg-operator", operator),)).clients_alive
                time.sleep(1.0)
            time.sleep(args.settle)
            pids = [w.pid for w in workers]
            s0, w0, t0 = _cpu_seconds(server.pid), sum(_cpu_seconds(p) for p in pids), time.monotonic()
            time.sleep(args.window)
            s1, w1, t1 = _cpu_seconds(server.pid), sum(_cpu_seconds(p) for p in pids), time.monotonic()
            alive_end = status(pb.StatusRequest(), timeout=5, metadata=(("fg-operator", operator),)).clients_alive
            threads = _threads(pids[0])
            all_threads = sum(_threads(p) for p in pids)
            channel.close()
        finally:
            for p in [*workers, server]:
                p.send_signal(signal.SIGTERM)
            for p in [*workers, server]:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        warnings = sum(log.read_text(errors="replace").count("security.insecure") for log in logs)
    wall = t1 - t0
    print(f"idle: {n} connected virtual clients in {len(workers)} worker processes, no round running; "
          f"{wall:.1f} s window ({alive_end} alive at its end)")
    print(f"    server CPU: {s1 - s0:.2f} s = {100 * (s1 - s0) / wall:.1f}% of one core")
    print(f"    client-host CPU (all {len(workers)} workers): {w1 - w0:.2f} s = {100 * (w1 - w0) / wall:.1f}% of "
          f"one core")
    print(f"    security.insecure warnings in the workers' logs: {warnings} ({len(workers)} processes); threads of "
          f"worker 0 ({min(per, n)} clients): {threads}; of all workers: {all_threads / n:.2f} per client")
    return 0


if __name__ == "__main__":
    sys.exit(main())
