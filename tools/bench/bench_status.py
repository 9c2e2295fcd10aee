"""Bytes one status poll costs as a federation ages: GetStatus's reply at chosen rounds of a no-op federation.

    python tools/bench/bench_status.py                  # 200 rounds, K = 2, polls at rounds 10 and 200
    python tools/bench/bench_status.py --at 10 100 1000 --rounds 1000

A server thread and K embedded no-op clients on loopback (plaintext). At each chosen round the operator's
``GetStatus`` is called twice, as raw bytes: without ``since_round`` (every round of the history: what the launcher
received on every poll before it followed the server) and with ``since_round`` = the round before the latest
(what the launcher's follower receives when one new round has completed). A server that predates
``since_round`` is measured for the first only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("-k", type=int, default=2, help="clients (all of them train every round)")
    ap.add_argument("--at", type=int, nargs="+", default=[10, 200], help="rounds to poll at")
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import grpc

    from fedclient import ClientConfig, FedClient
    from fedcore.config import ServerConfig, build_config
    from fedguard.v1 import fedguard_pb2 as pb
    from fedserver import ServerThread

    following = "since_round" in pb.StatusRequest.DESCRIPTOR.fields_by_name
    with tempfile.TemporaryDirectory(prefix="fedguard-bench-status-") as tmp:
        token = Path(tmp) / "operator.token"
        token.write_text("bench-operator\n")
        cfg = build_config(ServerConfig, None, [
            (["server", "address"], "127.0.0.1:0"), (["server", "run_dir"], str(Path(tmp) / "run")),
            (["security", "insecure"], True), (["security", "operator_token_file"], str(token)),
            # a few rounds more than polled at: the server still answers at the last poll
            (["rounds", "num_rounds"], args.rounds + 20), (["rounds", "clients_per_round"], args.k)])
        srv = ServerThread(cfg, linger_s=0.5).start()
        clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                          long_poll_s=2.0, trainer="noop")).start() for i in range(args.k)]
        channel = grpc.insecure_channel(srv.address)
        get_status = channel.unary_unary("/fedguard.v1.Federation/GetStatus",
                                         request_serializer=pb.StatusRequest.SerializeToString)
        metadata = (("fg-operator", "bench-operator"),)
        server = "since_round supported" if following else "a server without since_round"
        print(f"GetStatus reply bytes, no-op federation of {args.k} clients ({server})")
        print(f"{'round':>6} {'rows':>5} {'whole history':>14} {'rows':>5} {'since_round':>12}")
        try:
            for n in sorted(r for r in args.at if r <= args.rounds):
                srv.wait_for_round(n, timeout=600)
                whole: bytes = get_status(pb.StatusRequest(), timeout=30, metadata=metadata)
                reply = pb.StatusReply.FromString(whole)
                latest = reply.history[-1].round
                cells = f"{latest:>6} {len(reply.history):>5} {len(whole):>14}"
                if following:
                    since: bytes = get_status(pb.StatusRequest(since_round=latest - 1), timeout=30, metadata=metadata)
                    cells += f" {len(pb.StatusReply.FromString(since).history):>5} {len(since):>12}"
                print(cells, flush=True)
        finally:
            channel.close()
            srv.stop()
            for c in clients:
                c.stop(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
