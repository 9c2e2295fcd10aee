"""The full-knowledge adversary: a server-side TEST HARNESS for simulations (HYDRA-FL's threat model, App. C.1).

HYDRA-FL evaluates its defence against an adversary that sees the benign clients' updates of the round. A real
attacker client cannot, so fedguard simulates it on the server: with ``[simulation_harness]
full_knowledge_adversary = true`` (off by default; refused with TLS, mutual TLS or enrolled client keys, i.e. in
any production setting, by :func:`fedcore.config.validate_server_config`) the server, after a round closes and
before its rule runs, replaces the row of every accepted update from a client that joined as an attacker with a
row crafted from the round's benign rows (:func:`full_knowledge_rows`). The attacker clients themselves send
their honest updates (``attack.knowledge = "full"``).

The crafted rows go through the same validation and clipping as any upload; the round's report counts them
(``metrics["harness_crafted"]``, Dyn-Opt's ``metrics["harness_gamma"]``). Randomness (Stat-Opt's sampling) comes
from a generator seeded with ``derive_seed(federation seed, round, "harness")`` and the attackers' ids, so a
re-run crafts the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedcore.aggregation.rules import Rule, TrimmedMean
from fedcore.attacks.config import AttackConfig
from fedcore.attacks.config import SimulationHarnessConfig as SimulationHarnessConfig  # re-exported
from fedcore.attacks.model_poisoning import craft_rows
from fedcore.seeds import derive_seed


@dataclass(frozen=True)
class HarnessRows:
    """The crafted rows, one per attacker position of the input, and the numbers the round reports."""

    positions: tuple[int, ...]
    rows: torch.Tensor  # [len(positions), P]
    gamma: float = math.nan


def oracle_trimmed_mean(rule: Rule, n: int, num_attackers: int) -> Rule:
    """``rule`` when it is not a trimmed mean, else a trimmed mean that trims max(its own m, ``num_attackers``)
    values per side of ``n``, at most (n - 1) // 2 (the defender that knows the round's number of attackers)."""
    if not isinstance(rule, TrimmedMean):
        return rule
    return TrimmedMean(trim_m=min(max(rule.m(n), num_attackers), (n - 1) // 2))


def harness_seed(federation_seed: int, round_: int, attacker_keys: Sequence[str]) -> int:
    return derive_seed(federation_seed, round_, "harness", *sorted(attacker_keys))


def full_knowledge_rows(rows: torch.Tensor, keys: Sequence[str], attackers: set[str], attack: AttackConfig,
                        rule: Rule, seed: int) -> HarnessRows | None:
    """Crafted rows for the attackers among ``keys`` (row i is ``keys[i]``'s update), from the benign rows, against
    ``rule`` (the server's); ``None`` when the round has no attacker or no benign update to learn from."""
    if rows.shape[0] != len(keys):
        raise ValueError(f"{rows.shape[0]} rows for {len(keys)} keys")
    positions = tuple(i for i, k in enumerate(keys) if k in attackers)
    benign_idx = [i for i, k in enumerate(keys) if k not in attackers]
    if not positions or not benign_idx:
        return None
    benign = rows.index_select(0, torch.tensor(benign_idx, dtype=torch.long))
    g = torch.Generator().manual_seed(int(seed))
    crafted = craft_rows(attack, benign, len(positions), rule, g, knowledge="full")
    return HarnessRows(positions, crafted.rows, crafted.gamma)
