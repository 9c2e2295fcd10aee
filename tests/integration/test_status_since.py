"""GetStatus with ``since_round`` over real gRPC: a follower gets only the rounds it has not seen, so what one poll
costs does not grow with the federation's history."""

from __future__ import annotations

from pathlib import Path

from fedclient import ClientConfig, FedClient
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import OPERATOR_MD, server_config, stub


def test_since_round_returns_only_the_later_rounds_and_a_poll_does_not_grow(tmp_path: Path) -> None:
    cfg = server_config(tmp_path, rounds={"num_rounds": 40, "clients_per_round": 2})
    srv = ServerThread(cfg, linger_s=0.5).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=2.0, trainer="noop")).start() for i in range(2)]
    ch, s = stub(srv.address)
    try:
        srv.wait_for_round(3, timeout=120)
        early = s.GetStatus(pb.StatusRequest(since_round=2), timeout=10, metadata=OPERATOR_MD)
        srv.wait_for_round(30, timeout=240)
        whole = s.GetStatus(pb.StatusRequest(), timeout=10, metadata=OPERATOR_MD)
        done = whole.history[-1].round
        since = s.GetStatus(pb.StatusRequest(since_round=done - 1), timeout=10, metadata=OPERATOR_MD)
        beyond = s.GetStatus(pb.StatusRequest(since_round=10**6), timeout=10, metadata=OPERATOR_MD)
    finally:
        ch.close()
        status = srv.wait(240)
        for c in clients:
            c.stop(5)
    assert status is not None and status.outcome == "completed"
    assert [r.round for r in whole.history] == list(range(1, done + 1)) and done >= 30
    # Only the rounds after since_round; the rest of the status is the whole one.
    assert [r.round for r in since.history] in ([done], [done, done + 1], [done, done + 1, done + 2])
    assert early.history[0].round == 3 and not beyond.history
    assert beyond.federation_id == whole.federation_id and beyond.num_rounds == 40 and beyond.clients_known == 2
    # The rows are the server's rows, field for field.
    assert repr(wire.report_from_pb(since.history[0])) == repr(wire.report_from_pb(whole.history[-1]))
    # A poll costs the status plus its new rows; the whole history costs every row again on every poll.
    rows = [r.ByteSize() for r in whole.history]
    no_rows = pb.StatusReply()
    no_rows.CopyFrom(since)
    del no_rows.history[:]
    assert since.ByteSize() <= no_rows.ByteSize() + len(since.history) * (max(rows) + 4)
    # The status's own fields do not grow with the history either: polls taken at other moments differ only by the
    # round's phase and counts (a few varint bytes; `since` may be taken mid-aggregation, `beyond` mid-training).
    assert no_rows.ByteSize() <= beyond.ByteSize() + 32, (no_rows.ByteSize(), beyond.ByteSize())
    assert whole.ByteSize() >= beyond.ByteSize() + sum(rows) and len(rows) >= 30
