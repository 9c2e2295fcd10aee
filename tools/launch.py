"""Launch a federation on this machine: one ``fedserver`` plus N clients, printing one line per round.

    python -m tools.launch --clients 10 --rounds 20                 # 10 fedclient processes
    python -m tools.launch --clients 200 --virtual --procs 4        # 200 virtual clients in 4 processes
    python -m tools.launch --clients 10 -k 10 --trainer noop        # protocol only (benchmarks)

Every client is a real gRPC client with its own channel; in ``--virtual`` mode each process hosts many of
them as threads, each with its own shard (so a thousand clients fit on a small machine). Server options
not covered by a flag go through ``--server-set section.key=value``. Logs land in the run directory
(``server.log``, ``clients-*.log``); the final model and ``rounds.jsonl`` too.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

COLUMNS = ("round", "selected", "accepted", "rejected", "train_loss", "test_acc", "beta_hat", "nfl", "seconds")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fmt(v: float, digits: int = 4) -> str:
    return "-" if v != v else f"{v:.{digits}f}"  # NaN prints as "-"


def format_header() -> str:
    return "{:>5} {:>8} {:>8} {:>8} {:>10} {:>8} {:>8} {:>5} {:>8}".format(*COLUMNS)


def format_row(h: Any, nfl: str) -> str:
    beta = h.metrics.get("beta_hat_median", float("nan"))
    return (f"{h.round:>5} {h.selected:>8} {h.accepted:>8} {h.rejected:>8} {_fmt(h.mean_train_loss):>10} "
            f"{_fmt(h.mean_test_accuracy):>8} {_fmt(beta, 3):>8} {nfl:>5} {h.seconds:>8.3f}")


@dataclass
class Launch:
    server: subprocess.Popen[bytes]
    clients: list[subprocess.Popen[bytes]]
    address: str
    logs: list[IO[bytes]]


def start(args: argparse.Namespace, run_dir: Path) -> Launch:
    run_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or _free_port()
    address = f"127.0.0.1:{port}"
    root = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    py = sys.executable
    server_cmd = [py, "-m", "fedserver", "--address", address, "--rounds", str(args.rounds),
                  "-k", str(args.k or args.clients), "--run-dir", str(run_dir), "--log-json",
                  "--seed", str(args.seed), "--linger", "30"]
    if args.config:
        server_cmd += ["--config", args.config]
    if args.min_updates is not None:
        server_cmd += ["--min-updates", str(args.min_updates)]
    if args.round_timeout is not None:
        server_cmd += ["--round-timeout", str(args.round_timeout)]
    for item in args.server_set:
        server_cmd += ["--set", item]
    logs: list[IO[bytes]] = []
    slog = open(run_dir / "server.log", "wb")  # noqa: SIM115 (closed in finish())
    logs.append(slog)
    server = subprocess.Popen(server_cmd, stdout=slog, stderr=subprocess.STDOUT, env=env)
    clients: list[subprocess.Popen[bytes]] = []
    procs = args.procs if args.virtual else args.clients
    per_proc = math.ceil(args.clients / max(procs, 1))
    for p in range(procs):
        first = p * per_proc
        count = min(per_proc, args.clients - first)
        if count <= 0:
            break
        clog = open(run_dir / f"clients-{p}.log", "wb")  # noqa: SIM115
        logs.append(clog)
        if args.virtual:
            cmd = [py, "-m", "tools.launch", "worker", "--server", address, "--first", str(first), "--count",
                   str(count), "--trainer", args.trainer, "--straggler-delay", str(args.straggler_delay)]
        else:
            cmd = [py, "-m", "fedclient", "--server", address, "--client-id", f"client-{first:05d}",
                   "--data-index", str(first), "--trainer", args.trainer, "--straggler-delay",
                   str(args.straggler_delay), "--torch-threads", "1", "--log-json", "--log-level", "warning"]
        clients.append(subprocess.Popen(cmd, stdout=clog, stderr=subprocess.STDOUT, env=env))
    return Launch(server, clients, address, logs)


def watch(launch: Launch, interval: float = 0.1, out: IO[str] = sys.stdout) -> int:
    """Print each completed round as the server reports it; returns the server's exit code."""
    import grpc

    from fedguard.v1 import fedguard_pb2 as pb
    from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(launch.address)
    stub = pb_grpc.FederationStub(channel)  # type: ignore[no-untyped-call]
    printed = 0
    print(format_header(), file=out, flush=True)
    while True:
        rc = launch.server.poll()
        try:
            st = stub.GetStatus(pb.StatusRequest(), timeout=2.0)
            for h in st.history[printed:]:
                print(format_row(h, "off"), file=out, flush=True)
            printed = len(st.history)
        except grpc.RpcError:
            pass
        if rc is not None:
            channel.close()
            return rc
        time.sleep(interval)


def finish(launch: Launch, timeout: float = 30.0) -> list[int | None]:
    codes: list[int | None] = []
    deadline = time.monotonic() + timeout
    for c in launch.clients:
        try:
            codes.append(c.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            c.terminate()
            codes.append(None)
    for f in launch.logs:
        f.close()
    return codes


def run_worker(args: argparse.Namespace) -> int:
    """Host ``count`` virtual clients (threads, one gRPC channel each) in this process."""
    import torch

    from fedclient import ClientConfig, FedClient
    from fedcore.log import configure_logging

    torch.set_num_threads(1)
    configure_logging(json=True, level="warning")
    clients = [FedClient(ClientConfig(server=args.server, client_id=f"client-{i:05d}", data_index=i,
                                      trainer=args.trainer, straggler_delay_s=args.straggler_delay))
               for i in range(args.first, args.first + args.count)]
    for c in clients:
        c.start()
    failed = 0
    for c in clients:
        try:
            c.join()
        except Exception as e:  # one client's failure must not hide the others'
            print(f"{c.client_id}: {e}", file=sys.stderr)
            failed += 1
    finished = sum(c.summary.finished for c in clients)
    print(f"worker {args.first}-{args.first + args.count - 1}: {finished}/{len(clients)} finished, "
          f"{failed} failed", file=sys.stderr)
    return 0 if finished == len(clients) else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=10, help="number of clients N")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("-k", type=int, default=0, help="updates per round K (default: N)")
    ap.add_argument("--min-updates", type=int)
    ap.add_argument("--round-timeout", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", help="server TOML configuration")
    ap.add_argument("--server-set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--virtual", action="store_true", help="host many clients per process (threads)")
    ap.add_argument("--procs", type=int, default=2, help="client processes in --virtual mode")
    ap.add_argument("--trainer", default="sgd", choices=["sgd", "noop"])
    ap.add_argument("--straggler-delay", type=float, default=0.0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--run-dir", default="runs/launch")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        wp = argparse.ArgumentParser(prog="python -m tools.launch worker")
        wp.add_argument("--server", required=True)
        wp.add_argument("--first", type=int, required=True)
        wp.add_argument("--count", type=int, required=True)
        wp.add_argument("--trainer", default="sgd")
        wp.add_argument("--straggler-delay", type=float, default=0.0)
        return run_worker(wp.parse_args(argv[1:]))
    args = build_parser().parse_args(argv)
    if args.clients < 1 or args.rounds < 1:
        print("launch: --clients and --rounds must be >= 1", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    t0 = time.monotonic()
    launch = start(args, run_dir)
    print(f"fedguard: server {launch.address}, {args.clients} clients "
          f"({'virtual, ' + str(len(launch.clients)) + ' processes' if args.virtual else 'one process each'}), "
          f"{args.rounds} rounds, logs in {run_dir}/", flush=True)
    try:
        rc = watch(launch)
    except KeyboardInterrupt:
        launch.server.terminate()
        rc = launch.server.wait()
    codes = finish(launch)
    bad = [i for i, c in enumerate(codes) if c != 0]
    print(f"server exit {rc}; client processes ok {len(codes) - len(bad)}/{len(codes)}; "
          f"wall {time.monotonic() - t0:.1f} s; final model {run_dir / 'final_model.fgt'}", flush=True)
    if rc != 0:
        with contextlib.suppress(OSError):
            tail = (run_dir / "server.log").read_text().splitlines()[-5:]
            print("server log tail:\n  " + "\n  ".join(tail), file=sys.stderr)
    return rc if rc != 0 else (1 if bad else 0)


if __name__ == "__main__":
    sys.exit(main())
