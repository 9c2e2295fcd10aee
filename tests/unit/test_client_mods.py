"""Client mods (fedclient.mods): the simulated device and the attacks wrap the local round."""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from fedclient.connection import Connection
from fedclient.errors import FedClientError, SessionLost
from fedclient.local_round import RoundOutcome
from fedclient.mods import (
    CallNext,
    ModContext,
    RoundReply,
    RoundTask,
    attack_mods,
    attacker_epochs,
    backdoor,
    chain,
    client_mods,
    fabricated_beta_hat,
    label_flip,
    model_poisoning,
    simulated_device,
)
from fedclient.simulation import DeviceGone, DeviceSimulation
from fedcore.attacks import AttackConfig, UpdateContext, poison_client_data
from fedcore.config import ClientConfig, FederationInfo, TrainingConfig
from fedcore.data import ClientData
from fedcore.log import get_logger
from fedcore.models import model_manifest
from fedcore.simulation import SimulationConfig
from fedcore.update_report import UpdateReport

LOG = get_logger("test")


class FakeConnection(Connection):
    """A connection that records sleeps and heartbeat blocks instead of waiting or calling a server."""

    def __init__(self) -> None:
        super().__init__(ClientConfig(), "c0", LOG, threading.Event())
        self.session = "s"
        self.events: list[str] = []

    def sleep(self, seconds: float) -> None:
        self.events.append(f"sleep {seconds:g}")

    @contextlib.contextmanager
    def keep_alive(self) -> Iterator[None]:
        self.events.append("alive")
        yield
        self.events.append("idle")


def _data(n: int = 20) -> ClientData:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 4, generator=g), torch.arange(n) % 4
    return ClientData(x, y, x[:4], y[:4], 4)


def _ctx(sim: SimulationConfig | None = None) -> ModContext:
    model = nn.Linear(4, 4)
    fed = FederationInfo(federation_id="f", model_name="m", model_kwargs={}, model_fingerprint="",
                         model_spec=tuple(model_manifest(model)), training=TrainingConfig(local_epochs=2),
                         dataset="synthetic", data_options={}, num_rounds=3, seed=5)
    return ModContext("c0", LOG, fed, model, _data(), FakeConnection(), DeviceSimulation(sim or SimulationConfig(),
                                                                                        "c0", LOG))


def _task(ctx: ModContext) -> RoundTask:
    return RoundTask(1, {k: v.clone() for k, v in ctx.model.state_dict().items()}, False, None, ctx.data)


class Core:
    """The innermost step: records the task it got, 'trains' by adding 1 to every weight."""

    def __init__(self) -> None:
        self.tasks: list[RoundTask] = []

    def __call__(self, task: RoundTask, ctx: ModContext) -> RoundReply:
        self.tasks.append(task)
        assert isinstance(ctx.connection, FakeConnection)
        ctx.connection.events.append("train")
        with torch.no_grad():
            for p in ctx.model.parameters():
                p.add_(1.0)
        update = UpdateContext(received=task.weights, trained=ctx.model.state_dict(), honest_update=lambda i: i,
                               num_train=ctx.data.num_train, seed=1)
        sent = UpdateReport(num_samples=ctx.data.num_train, train_loss=0.5, beta_hat=-0.25, test_accuracy=0.5)
        return RoundReply(RoundOutcome(sent, -0.25, update))


def _events(ctx: ModContext) -> list[str]:
    assert isinstance(ctx.connection, FakeConnection)
    return ctx.connection.events


def test_chain_runs_mods_outermost_first_tasks_in_and_replies_out() -> None:
    seen: list[str] = []

    def mod(name: str) -> Any:
        def m(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
            seen.append(f"{name} in")
            reply = call_next(task, ctx)
            seen.append(f"{name} out")
            return reply
        return m

    ctx = _ctx()
    core = Core()
    reply = chain([mod("a"), mod("b")], core)(_task(ctx), ctx)
    assert seen == ["a in", "b in", "b out", "a out"] and len(core.tasks) == 1 and reply.outcome is not None
    assert chain([], core)(_task(ctx), ctx).outcome is not None  # no mods: the core alone


def test_an_inert_simulation_heartbeats_around_the_round_and_sends() -> None:
    ctx = _ctx()
    reply = chain([simulated_device], Core())(_task(ctx), ctx)
    assert reply.outcome is not None and _events(ctx) == ["alive", "train", "idle"]


def test_a_dropout_never_trains_and_stays_silent_then_comes_back_or_vanishes() -> None:
    ctx = _ctx(SimulationConfig(dropout=1.0, dropout_return_s=7.0))
    core = Core()
    reply = chain([simulated_device], core)(_task(ctx), ctx)
    assert reply.outcome is None and reply.reason == "dropout" and core.tasks == []
    assert _events(ctx) == ["sleep 7"]  # no heartbeat while it is silent
    gone = _ctx(SimulationConfig(dropout=1.0, dropout_return_s=-1.0))
    with pytest.raises(DeviceGone):
        chain([simulated_device], core)(_task(gone), gone)


def test_a_straggler_sleeps_after_training_while_heartbeating() -> None:
    ctx = _ctx(SimulationConfig(straggler_delay_s=3.0))
    reply = chain([simulated_device], Core())(_task(ctx), ctx)
    assert reply.outcome is not None and _events(ctx) == ["alive", "train", "sleep 3", "idle"]


def test_a_crash_trains_then_loses_the_update_and_the_session() -> None:
    ctx = _ctx(SimulationConfig(crash=1.0, crash_rejoin_s=2.0, straggler_delay_s=9.0))
    with pytest.raises(SessionLost):
        chain([simulated_device], Core())(_task(ctx), ctx)
    assert _events(ctx) == ["alive", "train", "idle", "sleep 2"]  # no straggler delay before a crash
    assert ctx.connection.session == ""


def test_a_closed_online_window_sends_nothing() -> None:
    ctx = _ctx(SimulationConfig(availability=[[0.0, 1e-9]]))
    reply = chain([simulated_device], Core())(_task(ctx), ctx)
    assert reply.outcome is None and reply.reason == "window closed"


def test_label_flip_trains_on_the_poisoned_data_only() -> None:
    ctx = _ctx()
    attack = AttackConfig(kind="label_flip", options={"flip": "reverse"})
    poisoned = poison_client_data(ctx.data, attack)
    core = Core()
    chain([label_flip(poisoned)], core)(_task(ctx), ctx)
    assert core.tasks[0].train_data is poisoned and not torch.equal(poisoned.y_train, ctx.data.y_train)


def test_backdoor_batches_and_an_attackers_epochs_reach_the_trainer() -> None:
    ctx = _ctx()
    attack = AttackConfig(kind="backdoor", options={"pairs": ((0, 1),)}, local_epochs_override=4)
    core = Core()
    chain([backdoor(attack), attacker_epochs(attack)], core)(_task(ctx), ctx)
    task = core.tasks[0]
    assert task.local_epochs == 4 and task.batches is not None
    _, yb = next(iter(task.batches(0)))
    assert len(yb) == 10 and int((yb == 1).sum()) >= 3  # LINDT's recipe (the defaults): 3 of every 10 poisoned
    # Without an override the federation's epochs stay (the mod is not even added).
    plain = Core()
    chain(attack_mods(AttackConfig(kind="backdoor", options={"pairs": ((0, 1),)}), ctx.data), plain)(_task(ctx), ctx)
    assert plain.tasks[0].local_epochs is None


def test_model_replacement_sends_the_boosted_update_with_its_metric() -> None:
    ctx = _ctx()
    received = _task(ctx)
    attack = AttackConfig(kind="model_replacement", options={"boost": 3.0})
    reply = chain([model_poisoning(attack)], Core())(received, ctx)
    assert reply.outcome is not None and reply.outcome.report.extras == {"attack_boost": 3.0}
    assert reply.outcome.report.test_accuracy == 0.5
    for k, v in ctx.model.state_dict().items():  # w^{r-1} + 3 * (trained - w^{r-1}), trained = w^{r-1} + 1
        assert torch.allclose(v, received.weights[k] + 3.0)


def test_full_knowledge_sends_the_trained_model() -> None:
    ctx = _ctx()
    task = _task(ctx)
    attack = AttackConfig(kind="stat_opt", knowledge="full")
    reply = chain([model_poisoning(attack)], Core())(task, ctx)
    assert reply.outcome is not None and "attack_boost" not in reply.outcome.report.extras
    assert all(torch.allclose(v, task.weights[k] + 1.0) for k, v in ctx.model.state_dict().items())


def test_a_fabricated_beta_hat_is_sent_the_measured_one_kept() -> None:
    ctx = _ctx()
    reply = chain([fabricated_beta_hat(0.75)], Core())(_task(ctx), ctx)
    assert reply.outcome is not None and reply.outcome.report.beta_hat == 0.75
    assert reply.outcome.beta_hat_measured == -0.25 and reply.outcome.report.test_accuracy == 0.5
    dropped = chain([fabricated_beta_hat(0.75), lambda t, c, n: RoundReply(None, "x")], Core())(_task(ctx), ctx)
    assert dropped.outcome is None


def test_a_clients_chain_by_attack() -> None:
    data = _data()
    names = {"none": [], "label_flip": ["label_flip"], "model_replacement": ["label_flip", "model_poisoning"],
             "dyn_opt": ["model_poisoning"]}
    for kind, want in names.items():
        mods = client_mods(AttackConfig(kind=kind), data)
        assert mods[0] is simulated_device
        assert [m.__qualname__.split(".")[0] for m in mods[1:]] == want
    fake = client_mods(AttackConfig(fake_beta_hat=-1.0), data)
    assert [m.__qualname__.split(".")[0] for m in fake[1:]] == ["fabricated_beta_hat"]
    assert not math.isnan(AttackConfig(fake_beta_hat=-1.0).fake_beta_hat)


def test_a_data_attack_the_data_cannot_carry_is_refused_at_set_up() -> None:
    only_class_3 = ClientData(torch.randn(8, 4), torch.full((8,), 3), torch.randn(2, 4), torch.full((2,), 3), 4)
    with pytest.raises(FedClientError, match="cannot run the backdoor attack"):
        attack_mods(AttackConfig(kind="backdoor", options={"pairs": ((0, 1),)}), only_class_3)
