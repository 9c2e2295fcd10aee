"""A round close computes the same whether its steps ran on a worker thread or on the event loop
(fedserver.offload): two loopback federations, one that never runs them on the loop, one that always does after
each step's first run, end with the same model bit for bit."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import fedserver.coordinator
from fedserver.offload import Offload
from tests.integration.helpers import server_config


class _Recording(Offload):
    """An Offload with a fixed line, recording on which thread each step ran."""

    runs: list[tuple[str, bool]]

    def __init__(self, inline_s: float) -> None:
        super().__init__(inline_s=inline_s)
        self.runs = []
        self.loop_thread = -1

    def _timed(self, step: str, fn: Any, *args: Any) -> Any:
        self.runs.append((step, threading.get_ident() == self.loop_thread))
        return super()._timed(step, fn, *args)

    async def run(self, step: str, fn: Any, *args: Any) -> Any:
        self.loop_thread = threading.get_ident()
        return await super().run(step, fn, *args)


def _federation(tmp: Path, inline_s: float, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, torch.Tensor],
                                                                                      list[tuple[str, bool]]]:
    from fedclient import ClientConfig, FedClient
    from fedserver import ServerThread

    made: list[_Recording] = []

    def factory() -> Offload:
        made.append(_Recording(inline_s))
        return made[-1]

    monkeypatch.setattr(fedserver.coordinator, "Offload", factory)
    cfg = server_config(tmp, rounds={"num_rounds": 4, "clients_per_round": 3})
    srv = ServerThread(cfg, linger_s=1.0).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=5.0)).start() for i in range(3)]
    status = srv.wait(120)
    for c in clients:
        c.join(30)
    assert status is not None and status.outcome == "completed", status
    assert srv.coordinator is not None and len(made) == 1
    closer = srv.coordinator.closer
    assert closer.offload is made[0] and closer.finalizer.offload is made[0]  # one record for the whole close
    return {k: v.clone() for k, v in srv.coordinator.global_state.items()}, made[0].runs


def test_a_close_on_the_loop_computes_what_a_close_on_a_worker_thread_does(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    threaded, off = _federation(tmp_path / "threads", -1.0, monkeypatch)  # never on the loop
    inline, on = _federation(tmp_path / "loop", float("inf"), monkeypatch)  # on the loop after each first run
    assert threaded.keys() == inline.keys()
    for name in threaded:
        assert torch.equal(threaded[name], inline[name]), name  # bit for bit: the same work on the same inputs
    assert [step for step, _ in off] == [step for step, _ in on] == ["aggregate", "complete_and_persist"] * 4
    assert not any(loop for _, loop in off)
    assert [loop for _, loop in on] == [False, False] + [True, True] * 3
