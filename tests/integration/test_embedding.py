"""Embedding API end to end over real gRPC on loopback (issue 29, docs/embedding.md).

The acceptance test: an app embeds a client and serves predictions from ``inference_model()`` in its own thread
while the federation runs; the federation's NFL state changes (reported, then cancelled under short-term recovery)
and the app sees the served model switch to the adapted one at the report and back at the cancel.

The NFL state is driven deterministically by three scripted clients over raw gRPC: they send back the model they
received with β̂ᵢ = -0.5 until their tasks carry the recovery flag (the report), then +0.5 (so the detector cancels
after c rounds). The embedded clients have no private model, so they send no β̂ᵢ and the round's median is the
scripted clients' value whatever the detector's thresholds are.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fedclient import ClientConfig, ClientNflState, ClientRoundReport, FedClient, ModelNotReady
from fedcore.config import ServerConfig
from fedcore.report import RoundReport
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import pull_model, server_config, stub, update_messages

ROUNDS = 9


class Scripted:
    """A raw-gRPC client that returns the received model unchanged with a scripted β̂ᵢ."""

    def __init__(self, address: str, client_id: str) -> None:
        self.address, self.client_id = address, client_id
        self.seen_recovery = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        ch, s = stub(self.address)
        try:
            sid = s.Join(pb.JoinRequest(client_id=self.client_id, capabilities=pb.Capabilities(
                num_train_samples=10)), timeout=10).session_id
            while not self.stop.is_set():
                header, state = pull_model(s, sid, max_wait=2.0)
                if state is None:
                    assert isinstance(header, pb.Wait)
                    if header.finished:
                        return
                    continue
                assert isinstance(header, pb.TaskHeader)
                self.seen_recovery = self.seen_recovery or header.recovery
                beta = 0.5 if self.seen_recovery else -0.5
                s.PushUpdate(update_messages(sid, header.round, state, beta_hat=beta), timeout=10)
        finally:
            ch.close()


@pytest.fixture
def scripted() -> Iterator[list[Scripted]]:
    made: list[Scripted] = []
    yield made
    for sc in made:
        sc.stop.set()
        sc.thread.join(10)


def _config(tmp_path: Path, n: int) -> ServerConfig:
    return server_config(tmp_path, rounds={"num_rounds": ROUNDS, "clients_per_round": n, "min_available": n,
                                           "seed": 5},
                         nfl={"detector": "beta_hat", "nr": 1, "c": 2, "recovery": "short-term"})


def test_an_app_serves_the_adapted_model_from_the_report_to_the_cancel(tmp_path: Path,
                                                                      scripted: list[Scripted]) -> None:
    reports: list[RoundReport] = []
    srv = ServerThread(_config(tmp_path, 5), linger_s=0.5, on_round_end=reports.append).start()
    changes: list[tuple[ClientNflState, ClientNflState]] = []
    models: list[tuple[str, int]] = []
    rounds: list[ClientRoundReport] = []
    common: dict[str, Any] = {"insecure": True, "server": srv.address, "long_poll_s": 5.0}
    app = FedClient(ClientConfig(client_id="app", data_index=0, infer_after_recovery="global", **common),
                    on_state_change=lambda old, new: changes.append((old, new)), on_round_end=rounds.append)
    app.on_model(lambda kind, model: models.append((kind, app.nfl_state.round)))
    # The default (FL-GUARD §5.1, SPEC §6): after recovery stops the client keeps inferring with v_i.
    keeper = FedClient(ClientConfig(client_id="keeper", data_index=1, **common))
    with pytest.raises(ModelNotReady):
        app.inference_model()

    served: list[tuple[str, int, torch.Tensor]] = []
    done = threading.Event()

    def serve_predictions() -> None:  # the app's serving thread
        probe: torch.Tensor | None = None
        while not done.is_set():
            try:
                s = app.served_model()
            except ModelNotReady:
                time.sleep(0.005)
                continue
            if probe is None:  # a batch of the model's input width (the synthetic task's features)
                width = next(s.model.parameters()).shape[1]
                probe = torch.randn(16, width, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                served.append((s.kind, s.round, s.model(probe).argmax(1)))
            time.sleep(0.005)

    server_thread = threading.Thread(target=serve_predictions, daemon=True)
    server_thread.start()
    app.start()
    keeper.start()
    for i in range(3):
        scripted.append(Scripted(srv.address, f"scripted-{i}"))
        scripted[-1].thread.start()
    try:
        status = srv.wait(120)
        app.join(30)
        keeper.join(30)
    finally:
        done.set()
        server_thread.join(10)
        app.stop()
        keeper.stop()
        srv.stop()
    assert status is not None and status.outcome == "completed", status
    assert [r.round for r in reports] == list(range(1, ROUNDS + 1))
    # The server reported NFL, then cancelled the report (short-term: the recovery flag is cleared).
    flagged = [r.round + 1 for r in reports if r.recovery]  # the rounds whose tasks carried recovery
    assert flagged, [(r.round, r.nfl, r.beta_hat_avg) for r in reports]
    first, last = flagged[0], flagged[-1]
    assert flagged == list(range(first, last + 1)) and last < ROUNDS, flagged
    assert reports[last - 1].nfl == "watching" and not reports[last - 1].recovery

    # What the app served, round by round: the global model up to the report, v_i while recovering, and the global
    # model again after the cancel. (In the first flagged round v_i exists only once that round has trained.)
    kinds: dict[int, list[str]] = {}
    for kind, round_, _ in served:
        kinds.setdefault(round_, []).append(kind)
    assert all(k == "global" for r, ks in kinds.items() if r < first for k in ks), kinds
    assert all(k == "adapted" for r, ks in kinds.items() if first < r <= last for k in ks), kinds
    assert all(k == "global" for r, ks in kinds.items() if r > last for k in ks), kinds
    assert any(k == "adapted" for ks in kinds.values() for k in ks), kinds
    assert any(r > last for r in kinds) and any(r < first for r in kinds), kinds
    # The two kinds really are different models: v_i is trained beside the global copy.
    adapted = [p for k, _, p in served if k == "adapted"]
    after = [p for k, r, p in served if k == "global" and r > last]
    assert adapted and after

    # Callbacks: state changes at the report and at the cancel, v_i published after each recovery round, one
    # report per round with the adapting flag the server asked for.
    on = [(o, n) for o, n in changes if not o.recovering and n.recovering]
    off = [(o, n) for o, n in changes if o.recovering and not n.recovering]
    assert len(on) == 1 and on[0][1].round == first and on[0][1].server_recovery and on[0][1].since_round == first
    assert len(off) == 1 and off[0][1].round == last + 1 and not off[0][1].serving_adapted
    assert [r for k, r in models if k == "adapted"] == list(range(first, last + 1))
    assert [r for k, r in models if k == "global"] == list(range(1, ROUNDS + 1))
    assert [r.round for r in rounds] == list(range(1, ROUNDS + 1))
    assert [r.update.adapting for r in rounds] == [first <= r.round <= last for r in rounds]
    assert all(r.accepted and r.update.num_samples > 0 and r.update.train_seconds > 0 for r in rounds)
    assert app.nfl_state == ClientNflState(recovering=False, since_round=0, serving_adapted=False,
                                           server_recovery=False, own_decision=False, opt_out=False,
                                           beta_hat=app.nfl_state.beta_hat, round=ROUNDS)
    # The keeper keeps v_i after the cancel; the app's global model is the keeper's (same federation, same round).
    assert keeper.served_model().kind == "adapted" and app.served_model().kind == "global"
    for (k, a), b in zip(app.global_model().state_dict().items(), keeper.global_model().state_dict().values(),
                         strict=True):
        assert torch.equal(a, b), k
    # The server's embedding API: its global model is the round-ROUNDS aggregate of what the clients sent.
    assert srv.latest_report() is not None and srv.latest_report().round == ROUNDS  # type: ignore[union-attr]
    assert set(srv.models()) == {"global"}


def test_a_device_that_cannot_train_declines_and_counts_as_unavailable_not_failed(tmp_path: Path) -> None:
    """client-2 is selected for round 1 and its app's can_train() says no when the task arrives: it declines, the
    server stops waiting for it (the round closes with the two others at once, not at the 30 s deadline), nothing is
    counted as rejected, and client-2 trains in the later rounds. The server's embedding API follows the run, and an
    on_round_end callback that raises does not stop the federation."""
    cfg = server_config(tmp_path, rounds={"num_rounds": 3, "clients_per_round": 3, "min_available": 3,
                                          "min_updates": 2, "round_timeout_s": 30.0, "seed": 2},
                        server={"heartbeat_interval_s": 0.5})
    seen: list[int] = []

    def on_round_end(report: RoundReport) -> None:
        seen.append(report.round)
        raise RuntimeError("an app bug")  # logged; the federation carries on

    srv = ServerThread(cfg, linger_s=0.5, on_round_end=on_round_end).start()
    coord = srv.coordinator
    assert coord is not None
    asked: list[bool] = []

    def can_train() -> bool:  # "not now" exactly while round 1 has this client selected
        ok = not srv.call(lambda: coord.state.round == 1 and "client-2" in coord.state.selected)
        asked.append(ok)
        return bool(ok)

    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=5.0), can_train=can_train if i == 2 else None).start()
               for i in range(3)]
    try:
        first = srv.wait_for_round(1, timeout=60)
        status = srv.wait(120)
        summaries = [c.join(30) for c in clients]
    finally:
        for c in clients:
            c.stop()
        srv.stop()
    assert status is not None and status.outcome == "completed", status
    assert first.round == 1 and first.selected == 3 and first.accepted == 2 and first.rejected == 0
    assert first.outcome == "all_responded" and first.seconds < 15.0, first
    assert [h.accepted for h in status.history] == [2, 3, 3] and status.rejected_total == 0
    assert [h["round"] for h in summaries[2].history] == [2.0, 3.0] and summaries[2].updates_rejected == 0
    assert False in asked and asked[-1] is True
    assert seen == [1, 2, 3]
    # The server's models: fresh modules equal to the final model it wrote.
    from fedcore.serialization import load_state

    final, _ = load_state(Path(cfg.server.run_dir) / "final_model.fgt")
    model = srv.global_model()
    assert set(srv.models()) == {"global"}
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k
    assert srv.latest_report() == status.history[-1]


def test_an_embedded_client_and_server_leave_logging_to_the_app(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """No handler is added to the root logger, nothing is printed to stdout, and the records reach a handler the
    app attaches to ``logging.getLogger("fedguard")``; a client's ``log_level`` is honoured."""
    import logging

    fedguard = logging.getLogger("fedguard")
    saved = (list(fedguard.handlers), fedguard.level, fedguard.propagate)
    for h in list(fedguard.handlers):  # the test session's console handler (tests/conftest.py): a pristine app
        if not isinstance(h, logging.NullHandler):
            fedguard.removeHandler(h)
    fedguard.propagate, fedguard.level = True, logging.NOTSET
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    keep = Keep()
    root_before = list(logging.getLogger().handlers)
    try:
        fedguard.addHandler(keep)
        fedguard.setLevel(logging.INFO)  # the app's choice
        cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": 2, "min_available": 2})
        with ServerThread(cfg, linger_s=0.3) as srv:
            clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=name, data_index=i,
                                              long_poll_s=5.0, log_level=level))
                       for i, (name, level) in enumerate((("loud", "info"), ("quiet", "warning")))]
            for c in clients:
                c.start()
            srv.wait(60)
            for c in clients:
                c.join(30)
        assert logging.getLogger().handlers == root_before
        assert capsys.readouterr().out == ""
        events = [(r.name, r.levelno, getattr(r, "fedguard", {})) for r in records]
        assert ("fedguard.client", logging.INFO) in [(n, lv) for n, lv, ev in events
                                                     if ev.get("event") == "client.joined"
                                                     and ev.get("client_id") == "loud"]
        assert not [ev for n, lv, ev in events
                    if n == "fedguard.client" and ev.get("client_id") == "quiet" and lv < logging.WARNING]
        # ... while the same event of "loud" (log_level info) is there: "quiet"'s log_level filtered it.
        assert all(ev.get("client_id") == "loud" for n, _, ev in events
                   if n == "fedguard.client" and ev.get("event") in ("client.joined", "client.finished"))
        assert any(n == "fedguard.server" and ev.get("event") == "round.completed" for n, _, ev in events)
        assert all(r.getMessage().startswith(getattr(r, "fedguard", {}).get("event", "")) for r in records)
    finally:
        fedguard.removeHandler(keep)
        fedguard.handlers[:], fedguard.level, fedguard.propagate = saved


def test_run_async_is_cancelled_cleanly(tmp_path: Path) -> None:
    """``await client.run_async()`` takes part; cancelling the task stops the client, which leaves the federation."""
    import asyncio

    cfg = server_config(tmp_path, rounds={"num_rounds": 50, "clients_per_round": 1, "min_available": 1})
    with ServerThread(cfg, linger_s=0.3) as srv:
        coord = srv.coordinator
        assert coord is not None

        async def app() -> FedClient:
            loop = asyncio.get_running_loop()
            trained = asyncio.Event()
            client = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="async", data_index=0,
                                            long_poll_s=5.0),
                               on_round_end=lambda report: loop.call_soon_threadsafe(trained.set))
            task = asyncio.ensure_future(client.run_async())
            await asyncio.wait_for(trained.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return client

        client = asyncio.run(app())
        assert client.summary.rounds_trained >= 1 and not client.summary.finished
        assert srv.call(lambda: coord.state.clients["async"].alive) is False  # it left
        assert srv.wait_for_round(1, timeout=30).round >= 1 and srv.latest_report() is not None


def test_a_restarted_client_serves_its_kept_adapted_model_from_its_first_task(tmp_path: Path) -> None:
    """v_i lives in the client's state dir: after a restart (a new process, here a new FedClient on the same state
    dir, in a new federation) the client serves it from the first task on, not only after a round of training."""
    state_dir = str(tmp_path / "device")

    def run(name: str, rounds: int) -> tuple[list[ClientNflState], list[str], FedClient]:
        cfg = server_config(tmp_path / name, rounds={"num_rounds": rounds, "clients_per_round": 1,
                                                     "min_available": 1},
                            nfl={"mode": "always-recover"})
        states: list[ClientNflState] = []
        kinds: list[str] = []
        with ServerThread(cfg, linger_s=0.3) as srv:
            client = FedClient(ClientConfig(insecure=True, server=srv.address, client_id="device", data_index=0,
                                            long_poll_s=5.0, state_dir=state_dir),
                               on_state_change=lambda old, new: states.append(new))
            client.on_model(lambda kind, model: kinds.append(kind))
            client.start()
            srv.wait(60)
            client.join(30)
        return states, kinds, client

    states, kinds, _ = run("first", 2)  # no v_i at the first task; v_i after the first round's training
    assert [(s.round, s.recovering, s.serving_adapted) for s in states] == [(1, True, False), (1, True, True)]
    assert kinds == ["global", "adapted", "global", "adapted"]
    states, kinds, client = run("second", 1)  # v_i from the state dir at once
    assert [(s.round, s.recovering, s.serving_adapted) for s in states] == [(1, True, True)]
    assert kinds == ["global", "adapted"] and client.served_model().kind == "adapted"
