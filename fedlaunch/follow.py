"""Follow a running federation: one table line per completed round, read from the server's ``GetStatus`` with
``since_round`` (each poll carries only the rounds not seen yet, so it costs the same at round 10 and 10,000),
until the server exits, a client host fails or an interrupt stops it."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any

from fedcore.config import ClientConfig
from fedcore.report import FederationStatus, RoundReport
from fedlaunch.credentials import OPERATOR_TOKEN, STATUS_CLIENT, client_tls_options
from fedlaunch.logs import clients_waiting
from fedlaunch.progress import Progress, eta, format_header, format_row, last_rounds_summary
from fedlaunch.supervise import Interrupts, Launch, Outcome, failed_client, stop_gracefully, stop_now


class StatusFollower:
    """A federation's rounds as they complete, from its operator ``GetStatus``: each call asks only for the rounds
    after the last one seen (``since_round``), so a poll costs the same at round 10 and at round 10,000."""

    def __init__(self, stub: Any, operator_token: str, last_round: int = 0) -> None:
        self.stub = stub  # a fedguard.v1 FederationStub
        self.metadata = [("fg-operator", operator_token)]
        self.last_round = last_round

    def poll(self, timeout: float) -> tuple[FederationStatus, list[RoundReport]]:
        """The status now and the rounds completed since the last poll (:class:`grpc.RpcError` when it fails)."""
        from fedguard import wire
        from fedguard.v1 import fedguard_pb2 as pb

        status = wire.status_from_pb(self.stub.GetStatus(pb.StatusRequest(since_round=self.last_round),
                                                         timeout=timeout, metadata=self.metadata))
        new = [r for r in status.history if r.round > self.last_round]  # an older server sends every round
        if new:
            self.last_round = new[-1].round
        return status, new


def jsonl_rows(run_dir: Path, after: int) -> list[RoundReport]:
    """Round reports from the server's rounds.jsonl after round ``after``."""
    path = run_dir / "rounds.jsonl"
    rows: list[RoundReport] = []
    if path.exists():
        for line in path.read_text().splitlines():
            r = RoundReport.from_dict(json.loads(line))
            if r.round > after:
                rows.append(r)
    return rows


def watch(launch: Launch, run_dir: Path, interval: float = 0.1, out: IO[str] = sys.stdout,
          tls_dir: Path | None = None, interrupts: Interrupts | None = None, num_rounds: int = 0,
          graceful_s: float = 3.0) -> Outcome:
    """Print each completed round as the server reports it (one line each) until the server exits, a process
    fails (its last error printed at once, the federation stopped), or an interrupt stops it."""
    import grpc

    from fedclient.transport import open_channel
    from fedguard.v1 import fedguard_pb2_grpc as pb_grpc

    channel = open_channel(ClientConfig(server=launch.address, **client_tls_options(tls_dir, STATUS_CLIENT)))
    follower = StatusFollower(pb_grpc.FederationStub(channel), OPERATOR_TOKEN)  # type: ignore[no-untyped-call]
    history: list[RoundReport] = []
    progress = Progress(out)
    interrupts = interrupts or Interrupts()
    print(format_header(), file=out, flush=True)
    t_start = time.monotonic()
    t_first_round: float | None = None
    first_round = 0  # the first round this launcher saw complete (a resumed run starts later)
    total = num_rounds
    next_poll = 0.0
    try:
        while True:
            rc = launch.server.poll()
            if interrupts.count:
                progress.clear()
                print("\nlaunch: stopping: the server saves the federation, clients leave (Ctrl-C again kills "
                      "everything at once)", file=sys.stderr, flush=True)
                return stop_gracefully(launch, interrupts, graceful_s, history)
            failed = failed_client(launch)
            if failed is not None and rc is None:
                progress.clear()
                print(f"launch: {failed}", file=sys.stderr, flush=True)
                stop_now(launch)
                return Outcome(launch.server.poll(), "failed", failed, history)
            now = time.monotonic()
            if now >= next_poll or rc is not None:
                next_poll = now + 0.5
                try:
                    st, new = follower.poll(timeout=1.0)
                    total = st.num_rounds or total
                    for h in new:
                        progress.clear()
                        print(format_row(h), file=out, flush=True)
                        history.append(h)
                        if t_first_round is None:
                            t_first_round, first_round = now, h.round
                except grpc.RpcError:
                    pass
            if rc is not None:
                progress.clear()
                # Rounds that completed after the last poll are in the server's rounds.jsonl.
                for h in jsonl_rows(run_dir, history[-1].round if history else 0):
                    print(format_row(h), file=out, flush=True)
                    history.append(h)
                if history:
                    print(last_rounds_summary(history), file=out, flush=True)
                return Outcome(rc, "finished" if rc == 0 else "failed", "", history)
            if not history:
                waiting = clients_waiting(run_dir)
                if waiting is not None:
                    ready, needed = waiting
                    progress.show(f"round 1 waits for clients (private models, joins): {ready}/{needed} ready, "
                                  f"{now - t_start:.0f} s, {eta(ready, needed, now - t_start)}")
            elif total and t_first_round is not None:
                done = history[-1].round
                progress.show(f"round {done}/{total} done, {now - t_start:.0f} s, "
                              f"{eta(done - first_round, total - first_round, now - t_first_round)}")
            time.sleep(interval)
    finally:
        channel.close()
