"""The launcher's and fedguard-status's follower asks GetStatus only for the rounds after the last one it has."""

from __future__ import annotations

from typing import Any

from fedcore.report import FederationStatus, RoundReport
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedlaunch.follow import StatusFollower


class FakeServer:
    """A GetStatus that records each request; ``honours_since``: False for a server older than since_round."""

    def __init__(self, honours_since: bool = True) -> None:
        self.rounds = 0
        self.requests: list[pb.StatusRequest] = []
        self.honours_since = honours_since

    def GetStatus(self, request: pb.StatusRequest, timeout: float, metadata: Any) -> pb.StatusReply:
        assert ("fg-operator", "op") in metadata
        self.requests.append(request)
        since = request.since_round if self.honours_since else 0
        history = tuple(RoundReport(round=r, accepted=r) for r in range(since + 1, self.rounds + 1))
        return wire.status_to_pb(FederationStatus(
            federation_id="f", round=self.rounds + 1, num_rounds=99, phase="sampling", outcome="", clients_known=2,
            clients_alive=2, selected=0, accepted=0, rejected=0, rejected_total=0, history=history, finished=False))


def _polls(server: FakeServer, follower: StatusFollower, completed: list[int]) -> list[list[int]]:
    seen = []
    for n in completed:
        server.rounds = n
        status, new = follower.poll(timeout=1.0)
        assert status.num_rounds == 99
        seen.append([r.round for r in new])
    return seen


def test_each_poll_asks_for_the_rounds_after_the_last_seen() -> None:
    server = FakeServer()
    follower = StatusFollower(server, "op")
    assert _polls(server, follower, [0, 2, 2, 3, 7]) == [[], [1, 2], [], [3], [4, 5, 6, 7]]
    assert [r.since_round for r in server.requests] == [0, 0, 2, 2, 3]
    assert follower.last_round == 7


def test_a_server_older_than_since_round_sends_everything_and_each_round_shows_once() -> None:
    server = FakeServer(honours_since=False)
    follower = StatusFollower(server, "op", last_round=1)
    assert _polls(server, follower, [1, 3, 4]) == [[], [2, 3], [4]]
