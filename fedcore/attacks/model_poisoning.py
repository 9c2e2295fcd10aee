"""Model poisoning: attacks that craft the update an attacker sends (SPEC §9; HYDRA-FL App. C.2).

Pure functions over flat float32 updates (``[P]`` rows, weights minus the model the client was handed), a seeded
``torch.Generator`` where an attack samples, and the robust rule the adversary assumes (threat model: the
adversary knows the server's aggregation rule, HYDRA-FL App. C.1):

- **model replacement** (Bagdasaryan et al.): the attacker's malicious update (trained on its poisoned data,
  :attr:`AttackConfig.flips_labels`) boosted by ``boost``: ``mal = boost · u_mal`` (:func:`model_replacement`).
- **Stat-Opt** (Fang et al., USENIX Security'20, the Trim attack): s = sign(μ) of the benign mean; with full
  knowledge each malicious coordinate is drawn uniformly between the benign extreme on the side opposite to s and
  that extreme scaled by b (``[w_max, b·w_max]`` or ``[w_max, w_max/b]`` where s < 0, ``[w_min/b, w_min]`` or
  ``[b·w_min, w_min]`` where s ≥ 0; b = 2); with partial knowledge (μ, σ estimated from the attackers' own benign
  updates) in ``[μ + 3σ, μ + 4σ]`` where s < 0 and ``[μ − 4σ, μ − 3σ]`` where s ≥ 0 (:func:`stat_opt`).
- **Dyn-Opt** (Shejwalkar & Houmansadr, NDSS'21, AGR-tailored): ``mal = μ − γ·dev`` with dev the benign
  coordinate-wise std (``"std"``), sign(μ) (``"sign"``) or μ/‖μ‖ (``"unit"``); every attacker sends the same
  ``mal``; γ by the halving search of their Algorithm 1 from γ = 10 (:func:`halving_search`): a selection rule
  (krum, multi_krum, bulyan) accepts γ when it selects a malicious row, so γ ends at the largest γ the rule
  accepts; any other rule (trimmed mean, median, ...) accepts γ when the aggregate moves further from μ than at
  the previous γ tried (the paper's objective ‖f(mal ∪ benign) − μ‖), pushing the output furthest from μ
  (:func:`dyn_opt`).

Where the benign statistics come from is the *knowledge* (:attr:`AttackConfig.knowledge`):

- ``"partial"`` (a real client, any deployment): the attacker estimates them from its own honest training: it
  trains ``estimate_shards`` honest updates from the received model on disjoint shards of its own data
  (a seeded split) and treats them as the benign sample (:func:`craft_update`, called through the client's update
  hook :func:`poison_update`).
- ``"full"`` (HYDRA-FL's threat model, simulation only): the attacker sends its honest update and the server-side
  test harness (:mod:`fedcore.attacks.harness`, off unless ``[simulation_harness]`` turns it on, refused with
  TLS/mTLS) replaces every attacker's row with one crafted from the round's benign rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fedcore.aggregation.rules import Rule, build_rule
from fedcore.attacks.config import DEV_TYPES as DEV_TYPES  # re-exported: the options live in attacks.config
from fedcore.attacks.config import KNOWLEDGE as KNOWLEDGE  # re-exported
from fedcore.attacks.config import CraftOptions as CraftOptions  # re-exported
from fedcore.attacks.config import DynOptOptions as DynOptOptions  # re-exported
from fedcore.attacks.config import ModelReplacementOptions as ModelReplacementOptions  # re-exported
from fedcore.attacks.config import StatOptOptions as StatOptOptions  # re-exported
from fedcore.attacks.config import assumed_aggregation
from fedcore.attacks.config import check_model_attack as check_model_attack  # re-exported
from fedcore.attacks.poisoning import (
    ATTACKS,
    AttackConfig,
    Crafted,
    PoisonedUpdate,
    UpdateContext,
)
from fedcore.seeds import derive_seed

# Rules that keep whole rows: Dyn-Opt's γ is accepted when a malicious row is kept.
SELECTION_RULES = ("krum", "multi_krum", "bulyan")
# Guard of the halving search (it converges in about log2(γ_init / tol) steps).
MAX_SEARCH_STEPS = 200


# ---- the attacks on flat updates ----

def model_replacement(update: torch.Tensor, boost: float) -> torch.Tensor:
    """Model replacement: the malicious update scaled by ``boost`` (Bagdasaryan et al.'s γ = n/η)."""
    return update * float(boost)


def _uniform(lo: torch.Tensor, hi: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(lo.shape, generator=generator, dtype=torch.float64)
    return (lo.double() + (hi.double() - lo.double()) * u).to(torch.float32)


def stat_opt(benign: torch.Tensor, num_mal: int, generator: torch.Generator, *, b: float = 2.0,
             knowledge: str = "full") -> torch.Tensor:
    """Fang et al.'s Trim attack: ``[num_mal, P]`` malicious rows from the benign rows ``[n, P]`` (module doc).

    ``knowledge="full"``: from the benign min/max scaled by a factor in [1, b]; ``"partial"``: from μ ± 3σ..4σ of
    the benign sample (σ the unbiased std; a single row has σ = 0). Each malicious row is drawn independently."""
    if benign.dim() != 2 or benign.shape[0] < 1:
        raise ValueError(f"stat_opt: need benign rows [n >= 1, P], got {tuple(benign.shape)}")
    if not (math.isfinite(b) and b >= 1):
        raise ValueError(f"attack.stat_b: must be a finite number >= 1, got {b}")
    x = benign.double()
    mu = x.mean(dim=0)
    up = mu >= 0  # s = +1: the benign models move up; the attack pushes down
    if knowledge == "full":
        wmax, wmin = x.max(dim=0).values, x.min(dim=0).values
        lo = torch.where(up, torch.where(wmin > 0, wmin / b, wmin * b), wmax)
        hi = torch.where(up, wmin, torch.where(wmax > 0, wmax * b, wmax / b))
    elif knowledge == "partial":
        sigma = x.std(dim=0) if x.shape[0] > 1 else torch.zeros_like(mu)
        lo = torch.where(up, mu - 4 * sigma, mu + 3 * sigma)
        hi = torch.where(up, mu - 3 * sigma, mu + 4 * sigma)
    else:
        raise ValueError(f"attack.knowledge: one of {', '.join(KNOWLEDGE)}, got {knowledge!r}")
    return torch.stack([_uniform(lo, hi, generator) for _ in range(num_mal)]) if num_mal else benign[:0].clone()


def deviation(benign: torch.Tensor, dev_type: str) -> torch.Tensor:
    """Dyn-Opt's perturbation direction dev (``mal = μ − γ·dev``): the coordinate-wise std of the benign rows
    (unbiased; 0 for one row), sign(μ), or the unit vector μ/‖μ‖."""
    mu = benign.double().mean(dim=0)
    if dev_type == "std":
        return (benign.double().std(dim=0) if benign.shape[0] > 1 else torch.zeros_like(mu)).float()
    if dev_type == "sign":
        return torch.sign(mu).float()
    if dev_type == "unit":
        norm = torch.linalg.vector_norm(mu)
        return (mu / norm if float(norm) > 0 else torch.zeros_like(mu)).float()
    raise ValueError(f"attack.dev_type: one of {', '.join(DEV_TYPES)}, got {dev_type!r}")


def halving_search(accept: Callable[[float], bool], gamma_init: float = 10.0, tol: float = 1e-5) -> float:
    """Shejwalkar & Houmansadr's Algorithm 1: start at γ = ``gamma_init`` with step γ_init; when ``accept(γ)``
    remember γ and go up by step/2, else down by step/2; halve the step; stop when the last accepted γ and the
    next candidate differ by at most ``tol``. Returns the last accepted γ (0 when none was). For a monotone
    ``accept`` (true exactly on [0, γ*]) that is the largest accepted γ up to ``tol`` (γ* < 2·γ_init)."""
    if not (math.isfinite(gamma_init) and gamma_init > 0):
        raise ValueError(f"attack.gamma_init: must be a finite number > 0, got {gamma_init}")
    if not (math.isfinite(tol) and tol > 0):
        raise ValueError(f"attack.gamma_tol: must be a finite number > 0, got {tol}")
    gamma, step, succ = float(gamma_init), float(gamma_init), 0.0
    for _ in range(MAX_SEARCH_STEPS):
        if abs(succ - gamma) <= tol:
            break
        if accept(gamma):
            succ = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return succ


def _with_mal(benign: torch.Tensor, mal: torch.Tensor, num_mal: int) -> torch.Tensor:
    return torch.cat([mal.unsqueeze(0).expand(num_mal, -1), benign.float()])


@dataclass(frozen=True)
class DynOptResult:
    update: torch.Tensor  # the malicious row [P] every attacker sends
    gamma: float
    deviation_norm: float  # ‖f(mal ∪ benign) − μ‖ at γ


def dyn_opt(benign: torch.Tensor, num_mal: int, rule: Rule, *, dev_type: str = "std", gamma_init: float = 10.0,
            tol: float = 1e-5) -> DynOptResult:
    """Dyn-Opt against ``rule`` with ``num_mal`` identical malicious rows beside the benign rows ``[n, P]``."""
    if benign.dim() != 2 or benign.shape[0] < 1 or num_mal < 1:
        raise ValueError(f"dyn_opt: need benign rows [n >= 1, P] and num_mal >= 1, got {tuple(benign.shape)}, "
                         f"{num_mal}")
    mu = benign.double().mean(dim=0).float()
    dev = deviation(benign, dev_type)
    n = benign.shape[0] + num_mal
    rule.check(n)
    weights = torch.ones(n, dtype=torch.float64)

    def aggregate(gamma: float) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        out = rule(_with_mal(benign, mu - gamma * dev, num_mal), weights)
        return out.step, out.selected

    if rule.name in SELECTION_RULES:
        def accept(gamma: float) -> bool:
            _, selected = aggregate(gamma)
            return selected is not None and any(i < num_mal for i in selected)
    else:
        previous = [-math.inf]

        def accept(gamma: float) -> bool:
            step, _ = aggregate(gamma)
            dist = float(torch.linalg.vector_norm(step.double() - mu.double()))
            better = dist > previous[0]
            previous[0] = dist
            return better

    gamma = halving_search(accept, gamma_init, tol)
    mal = mu - gamma * dev
    step, _ = aggregate(gamma)
    return DynOptResult(mal, gamma, float(torch.linalg.vector_norm(step.double() - mu.double())))


def assumed_rule(rule: str, f: int) -> Rule:
    """The robust rule the adversary assumes the server runs, with ``f`` trimmed per side / Byzantine clients
    (trimmed_mean's trim_m, krum's f)."""
    return build_rule(assumed_aggregation(rule, f))


# ---- one entry point for both knowledge modes ----

def craft_rows(attack: AttackConfig, benign: torch.Tensor, num_mal: int, rule: Rule, generator: torch.Generator, *,
               knowledge: str) -> Crafted:
    """``num_mal`` malicious rows of ``attack.kind`` (one that crafts: stat_opt, dyn_opt) from the benign rows (true
    or estimated), with the attack's options."""
    craft = attack.kind_.craft
    if craft is None:
        crafting = ", ".join(n for n in ATTACKS.names() if ATTACKS.get(n).craft is not None)
        raise ValueError(f"attack.kind: {attack.kind!r} does not craft from benign statistics ({crafting} do)")
    return craft(attack, benign, num_mal, rule, generator, knowledge)


def stat_opt_rows(attack: AttackConfig, benign: torch.Tensor, num_mal: int, rule: Rule,
                   generator: torch.Generator, knowledge: str) -> Crafted:
    b = attack.options_as(StatOptOptions).stat_b
    return Crafted(stat_opt(benign, num_mal, generator, b=b, knowledge=knowledge))


def dyn_opt_rows(attack: AttackConfig, benign: torch.Tensor, num_mal: int, rule: Rule,
                  generator: torch.Generator, knowledge: str) -> Crafted:
    o = attack.options_as(DynOptOptions)
    res = dyn_opt(benign, num_mal, rule, dev_type=o.dev_type, gamma_init=o.gamma_init, tol=o.gamma_tol)
    return Crafted(res.update.unsqueeze(0).expand(num_mal, -1).clone(), res.gamma)


# ---- the client's update hook (partial knowledge) ----

def float_names(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The floating-point tensors of a state dict, in order: what an update is made of (the server's flattening)."""
    return [k for k, v in state.items() if v.is_floating_point()]


def flat_update(trained: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``trained − received`` over the floating-point tensors as one float32 ``[P]`` vector."""
    names = float_names(received)
    if not names:
        return torch.zeros(0)
    return torch.cat([(trained[k].detach().cpu().float() - received[k].detach().cpu().float()).reshape(-1)
                      for k in names])


def weights_from_update(received: Mapping[str, torch.Tensor], update: torch.Tensor) -> dict[str, torch.Tensor]:
    """``received + update`` as a state dict (non-float tensors, e.g. BatchNorm's counters, from ``received``)."""
    out = {k: v.detach().cpu().clone() for k, v in received.items()}
    offset = 0
    for k in float_names(received):
        t = out[k]
        n = t.numel()
        out[k] = (t.float() + update[offset : offset + n].reshape(t.shape)).to(t.dtype)
        offset += n
    if offset != update.numel():
        raise ValueError(f"update has {update.numel()} values, the model {offset}")
    return out


def shard_indices(n: int, shards: int, seed: int) -> list[torch.Tensor]:
    """A seeded split of ``range(n)`` into ``shards`` disjoint, nearly equal, non-empty parts (fewer if n is
    smaller)."""
    g = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=g)
    return [p for p in torch.tensor_split(perm, min(shards, n)) if len(p)]


def poison_update(attack: AttackConfig, ctx: UpdateContext) -> PoisonedUpdate | None:
    """The client's update hook: the weights to send instead of ``ctx.trained``, or ``None`` to send it as is
    (no model attack, or full knowledge: the server-side harness crafts the row)."""
    poison = attack.kind_.poison
    if poison is None or attack.knowledge == "full":
        return None
    return poison(attack, ctx)


def replace_model(attack: AttackConfig, ctx: UpdateContext) -> PoisonedUpdate:
    """Model replacement: the trained (label-flipped) update, boosted."""
    boost = attack.options_as(ModelReplacementOptions).boost
    mal = model_replacement(flat_update(ctx.trained, ctx.received), boost)
    return PoisonedUpdate(weights_from_update(ctx.received, mal), {"attack_boost": boost})


def craft_from_own_shards(attack: AttackConfig, ctx: UpdateContext) -> PoisonedUpdate:
    """Partial knowledge: honest updates on shards of the attacker's own data stand in for the benign rows."""
    o = attack.options_as(CraftOptions)
    parts = shard_indices(ctx.num_train, o.estimate_shards, derive_seed(ctx.seed, "attack_shards"))
    if len(parts) < 2:
        raise ValueError(f"attack.estimate_shards: partial knowledge needs at least 2 training samples to "
                         f"estimate benign statistics, the client has {ctx.num_train}")
    benign = torch.stack([ctx.honest_update(idx) for idx in parts])
    g = torch.Generator().manual_seed(derive_seed(ctx.seed, "attack_sample"))
    crafted = craft_rows(attack, benign, o.assumed_attackers, attack_rule(attack), g, knowledge="partial")
    metrics = {"attack_estimate_shards": float(len(parts))}
    if math.isfinite(crafted.gamma):
        metrics["attack_gamma"] = crafted.gamma
    return PoisonedUpdate(weights_from_update(ctx.received, crafted.rows[0]), metrics)


def attack_rule(a: AttackConfig) -> Rule:
    """The rule the attacker assumes: ``assumed_rule`` with ``assumed_attackers`` trimmed / Byzantine."""
    o = a.options_as(CraftOptions)
    return assumed_rule(o.assumed_rule, o.assumed_attackers)


# The kinds registered above: the attacker crafts the update it sends.
MODEL_KINDS = tuple(name for name in ATTACKS.names() if ATTACKS.get(name).poisons_model)

__all__: Sequence[str] = (
    "DEV_TYPES",
    "KNOWLEDGE",
    "MODEL_KINDS",
    "SELECTION_RULES",
    "CraftOptions",
    "DynOptOptions",
    "DynOptResult",
    "ModelReplacementOptions",
    "StatOptOptions",
    "assumed_rule",
    "attack_rule",
    "check_model_attack",
    "craft_rows",
    "deviation",
    "dyn_opt",
    "flat_update",
    "float_names",
    "halving_search",
    "model_replacement",
    "poison_update",
    "shard_indices",
    "stat_opt",
    "weights_from_update",
)
