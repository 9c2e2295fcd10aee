"""Client mods: what wraps the local round, in the shape of Flower's client mods, ``mod(task, ctx, call_next)``.

The round runner hands each task to a chain of mods that ends in the local round (:meth:`RoundRunner._train`).
A mod may change the task on its way in (the data or the batches the trainer sees, the number of local epochs),
change the reply on its way out (the weights or the β̂ᵢ that are sent), not call the rest at all (the device drops
the task), or act around it (sleep as a straggler, crash after training). The experiments' behaviours -- attacks
and simulated device faults -- are mods, so the client's shell has no branch for any of them and a new one is a new
mod, not a new ``if`` in :class:`fedclient.FedClient`.

:func:`client_mods` builds a client's chain from its configuration: :func:`simulated_device` first (it decides
whether the round happens at all), then the attack's mods. Order, outermost first; each mod sees the task after the
mods before it and the reply before them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import torch
from torch import nn

from fedclient.connection import Connection
from fedclient.errors import FedClientError, SessionLost
from fedclient.local_round import RoundOutcome
from fedclient.simulation import DeviceGone, DeviceSimulation
from fedcore.attacks import AttackConfig, AttackError, attacker_local_epochs, backdoor_batches, poison_client_data
from fedcore.attacks import poison_update as craft_update
from fedcore.config import FederationInfo
from fedcore.data import ClientData
from fedcore.seeds import round_seeds
from fedcore.simulation import CRASH, DROP
from fedcore.train.loop import Batches


@dataclass(frozen=True)
class RoundTask:
    """One task as the local round gets it: ``weights`` the received model w^{r-1}, ``recovery`` the server's
    recovery flag, ``learning_rate`` the round's (None: the federation's); what the trainer trains on:
    ``train_data`` (the client's data unless a mod poisons it), ``batches`` (None: seeded batches of
    ``train_data``) and ``local_epochs`` (None: the federation's)."""

    round: int
    weights: dict[str, torch.Tensor]
    recovery: bool
    learning_rate: float | None
    train_data: ClientData
    batches: Batches | None = None
    local_epochs: int | None = None


@dataclass(frozen=True)
class RoundReply:
    """What a round gives back: ``outcome`` to send (the update itself is in :attr:`ModContext.model`), or None
    when nothing is sent this round (``reason`` says why)."""

    outcome: RoundOutcome | None
    reason: str = ""


@dataclass(frozen=True)
class ModContext:
    """What a mod may use: the client, the federation, the model that ends as the update, the client's clean data,
    the connection (sleeps that :meth:`FedClient.stop` ends, heartbeats, the session) and the device simulation."""

    client_id: str
    log: Any
    fed: FederationInfo
    model: nn.Module
    data: ClientData
    connection: Connection
    sim: DeviceSimulation


CallNext = Callable[[RoundTask, ModContext], RoundReply]
Mod = Callable[[RoundTask, ModContext, CallNext], RoundReply]


def chain(mods: Sequence[Mod], core: CallNext) -> CallNext:
    """``core`` wrapped by ``mods``, the first outermost."""

    def wrap(call_next: CallNext, mod: Mod) -> CallNext:
        return lambda task, ctx: mod(task, ctx, call_next)

    return reduce(wrap, reversed(mods), core)


# ---- the device simulation (stragglers, dropouts, crashes, availability windows) ----


def simulated_device(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
    """The task's fate (:mod:`fedcore.simulation`): a dropout keeps the task and stays silent (no heartbeat), then
    comes back or vanishes; a straggler sleeps after training (heartbeating, it is alive); a crash loses the update
    and the session and re-joins after a pause, as a restarted process would (the state dir is kept); an online
    window that ended during the round sends nothing. Inert without simulation options."""
    fate = ctx.sim.fate(task.round)
    conn = ctx.connection
    if fate.outcome == DROP:
        back = ctx.sim.config.dropout_return_s
        ctx.log.info("simulation.dropout", client_id=ctx.client_id, round=task.round,
                     back_in_s=back if back >= 0 else None)
        if back < 0:
            raise DeviceGone
        conn.sleep(back)
        return RoundReply(None, "dropout")
    with conn.keep_alive():
        reply = call_next(task, ctx)
        if fate.delay_s and fate.outcome != CRASH:
            conn.sleep(fate.delay_s)
    if fate.outcome == CRASH:
        rejoin = ctx.sim.config.crash_rejoin_s
        ctx.log.info("simulation.crash", client_id=ctx.client_id, round=task.round, rejoin_in_s=rejoin)
        conn.session = ""
        conn.sleep(rejoin)
        raise SessionLost  # the runner joins again
    if not ctx.sim.online():
        ctx.log.info("simulation.window_closed", client_id=ctx.client_id, round=task.round,
                     reason="the online window ended before the update was sent: never sent")
        return RoundReply(None, "window closed")
    return reply


# ---- attacks (simulation only) ----


def label_flip(poisoned: ClientData) -> Mod:
    """Data poisoning: the trainer trains on ``poisoned`` (the client's data with flipped labels); the client's
    test accuracy and β̂ᵢ still measure its clean data."""

    def mod(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
        return call_next(dataclasses.replace(task, train_data=poisoned), ctx)

    return mod


def backdoor(attack: AttackConfig) -> Mod:
    """Data poisoning: each batch mixes clean samples with triggered ones relabelled to the target, seeded by the
    round's attack seed."""

    def mod(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
        seed = round_seeds(ctx.fed.seed, ctx.client_id, task.round).attack
        return call_next(dataclasses.replace(task, batches=backdoor_batches(task.train_data, attack, seed).epoch),
                         ctx)

    return mod


def attacker_epochs(attack: AttackConfig) -> Mod:
    """An attacker's own number of local epochs (``attack.local_epochs_override``)."""

    def mod(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
        epochs = attacker_local_epochs(attack, ctx.fed.training.local_epochs)
        return call_next(dataclasses.replace(task, local_epochs=epochs), ctx)

    return mod


def model_poisoning(attack: AttackConfig) -> Mod:
    """Model poisoning: after training, the weights sent are the crafted update's
    (:func:`fedcore.attacks.poison_update`: model replacement, Stat-Opt, Dyn-Opt with partial knowledge), with the
    attack's metrics; with full knowledge the server-side harness crafts the row and the trained model is sent."""

    def mod(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
        reply = call_next(task, ctx)
        out = reply.outcome
        if out is None or out.update is None:
            return reply
        crafted = craft_update(attack, out.update)
        if crafted is None:
            return reply
        ctx.model.load_state_dict(crafted.weights)
        sent = dataclasses.replace(out.report, extras={**out.report.extras, **crafted.metrics})
        return dataclasses.replace(reply, outcome=dataclasses.replace(out, report=sent))

    return mod


def fabricated_beta_hat(value: float) -> Mod:
    """The fabricated-β̂ attacker: sends ``value`` as its β̂ᵢ (the measured one stays in
    ``RoundOutcome.beta_hat_measured``)."""

    def mod(task: RoundTask, ctx: ModContext, call_next: CallNext) -> RoundReply:
        reply = call_next(task, ctx)
        if reply.outcome is None:
            return reply
        sent = dataclasses.replace(reply.outcome.report, beta_hat=value)
        return dataclasses.replace(reply, outcome=dataclasses.replace(reply.outcome, report=sent))

    return mod


def attack_mods(attack: AttackConfig, data: ClientData) -> list[Mod]:
    """The mods that play ``attack`` on a client whose data is ``data`` (none without an attack); a data attack
    that ``data`` cannot carry is refused here, at the first join, not in the first round."""
    mods: list[Mod] = []
    try:
        if attack.flips_labels:
            mods.append(label_flip(poison_client_data(data, attack)))
        elif attack.kind == "backdoor":
            backdoor_batches(data, attack, 0)  # fails early if the data cannot carry the backdoor
            mods.append(backdoor(attack))
    except AttackError as e:
        raise FedClientError(f"cannot run the {attack.kind} attack on this client's data: {e}") from None
    if attack.active and attacker_local_epochs(attack, 0) > 0:
        mods.append(attacker_epochs(attack))
    if attack.poisons_model:
        mods.append(model_poisoning(attack))
    if attack.fabricates_beta_hat:
        mods.append(fabricated_beta_hat(attack.fake_beta_hat))
    return mods


def client_mods(attack: AttackConfig, data: ClientData) -> list[Mod]:
    """A client's chain, outermost first: the simulated device, then its attack's mods."""
    return [simulated_device, *attack_mods(attack, data)]


__all__ = ["CallNext", "Mod", "ModContext", "RoundReply", "RoundTask", "attack_mods", "attacker_epochs", "backdoor",
           "chain", "client_mods", "fabricated_beta_hat", "label_flip", "model_poisoning", "simulated_device"]
