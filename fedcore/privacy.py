"""The privacy budget of server-side DP: the cumulative (ε, δ) after every round (docs/privacy.md).

The mechanism (:mod:`fedcore.aggregation.steps`, SPEC §5, LINDT Eq. 4) is user-level and server-side: every
client's update is clipped to L2 norm S (``aggregation.clip_norm``), the clipped updates are averaged with weights
``w_i`` (sample counts when ``aggregation.weighted``, else 1), and ``N(0, σ² I)`` is added to that *average*
(``aggregation.noise_sigma`` is the absolute standard deviation, not a multiplier of S):

    w^r = w^{r-1} + Σ_i (w_i / W) Clip(u_i, S) + N(0, σ² I),   W = Σ_i w_i.

One client's clipped update moves the average by at most ``S · w_i / W``, so the L2 sensitivity of the noised
quantity in round r is ``Δ_r = S · s_r`` with ``s_r = max_i w_i / W`` the round's largest weight share (``1/n_r``
for the plain mean over n_r updates) and the noise multiplier of the round is ``z_r = σ / Δ_r``. The round's
clients are a sample of ``m_r`` (selected) of the N clients (``dp.population``, default ``data.options.num_clients``),
``q_r = m_r / N``; without a known N the accountant takes ``q = 1`` (no amplification by sampling: an upper bound).

Composition over rounds uses Rényi DP of the sampled Gaussian mechanism (Mironov et al. 2019) as implemented by
Opacus (``opacus.accountants.analysis.rdp``, the functions behind ``RDPAccountant``; the optional extra ``dp``),
at Opacus' own RDP orders, converted to (ε, δ) by Opacus' ``get_privacy_spent``. The state is the cumulative RDP
vector: :func:`init` / :func:`update` are pure, so the server saves it with each round's snapshot and a resumed
server carries on from it.

Adaptive clipping (``[adaptive_clip]``, :mod:`fedcore.adaptive_clip`; Andrew et al., NeurIPS 2021): round r clips to
its own ``C_r``, adds ``N(0, σ_r² I)`` with ``σ_r = z_Δ · C_r · s_r`` and releases the count of unclipped updates with
``N(0, σ_b²)``. The pair is charged as ONE sampled Gaussian mechanism with noise multiplier
``z = (z_Δ^{-2} + (2σ_b)^{-2})^{-1/2}`` (``adaptive_clip.noise_multiplier``; their Theorem 1): the count is taken as
``Σ_i (b_i − ½) + m_r/2`` with the divisor ``m_r`` public (sensitivity ½), and ``C_r`` is a function of the earlier
rounds' releases, which RDP composition allows (adaptive composition). :func:`round_mechanism` checks that the round's
metrics (``clip_norm``, ``noise_sigma``, ``max_weight_share``) give back ``z_Δ`` before charging ``z``.

Caveats, also stated in docs/privacy.md: Opacus' analysis assumes Poisson sampling and treats the divisor as
public, while fedguard samples a fixed number of clients uniformly and divides by the number that answered
(``accepted``, reported in every round); the weight share of a weighted average depends on the clients' sample
counts, which are then assumed public. Only averaging rules have this sensitivity: for the robust rules (median,
trimmed mean, Krum, Bulyan, K-norm) no round is accounted (ε = null), nor under DistFL, whose clustering reads the
clients' raw models.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcore.adaptive_clip import AdaptiveClipConfig, update_noise_multiplier
from fedcore.aggregation import AggregationConfig

# Opacus' RDPAccountant.DEFAULT_ALPHAS (opacus/accountants/rdp.py): the Rényi orders epsilon is minimised over.
ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)])
ON_BUDGET = ("warn", "stop")
# The aggregation rules whose output is a (weighted) mean of the clipped updates.
AVERAGING_RULES = ("fedavg",)
INSTALL_HINT = "pip install 'fedguard[dp]' (Opacus)"


@dataclass
class DpConfig:
    """The privacy accounting of server-side DP (``[dp]``); the mechanism itself is configured in ``[aggregation]``
    (``clip_norm`` S, ``noise_sigma`` σ)."""

    # Compute the cumulative (epsilon, delta) of server-side DP after every round (needs the dp extra: Opacus);
    # only when aggregation.clip_norm is set and aggregation.noise_sigma > 0.
    accounting: bool = True
    # delta of the reported (epsilon, delta) guarantee: the probability the guarantee may fail. 1e-5 (Opacus' and
    # TensorFlow Privacy's examples) is well below 1/N for fleets up to ~10,000 clients; take it smaller than 1/N.
    delta: float = 1e-5
    # N, the number of clients a round samples from (q = selected / N); 0 uses data.options.num_clients, and
    # without that the accountant takes q = 1 (no amplification by sampling, an upper bound).
    population: int = 0
    # A budget: when the cumulative epsilon exceeds it, dp.budget_exceeded is logged (once) and on_budget applies;
    # unset (None), no budget.
    max_epsilon: float | None = None
    # "warn": log and go on; "stop": the federation ends cleanly after the round that crossed max_epsilon (outcome
    # "dp_budget", final model written; a restart does not run more rounds).
    on_budget: str = "warn"

    def validate(self, prefix: str = "dp") -> DpConfig:
        if not (math.isfinite(self.delta) and 0.0 < self.delta < 1.0):
            raise ValueError(f"{prefix}.delta: must be in (0, 1), got {self.delta}")
        if self.population < 0:
            raise ValueError(f"{prefix}.population: must be >= 0 (0: data.options.num_clients), got {self.population}")
        if self.max_epsilon is not None and not (math.isfinite(self.max_epsilon) and self.max_epsilon > 0):
            raise ValueError(f"{prefix}.max_epsilon: must be a finite number > 0 (or unset), got {self.max_epsilon}")
        if self.on_budget not in ON_BUDGET:
            raise ValueError(f"{prefix}.on_budget: one of {', '.join(ON_BUDGET)}, got {self.on_budget!r}")
        return self


@dataclass(frozen=True)
class RoundMechanism:
    """One round as the accountant sees it: the sampled Gaussian mechanism with noise multiplier ``z`` (noise std
    over the L2 sensitivity of the noised quantity) and sampling rate ``q``."""

    noise_multiplier: float
    sample_rate: float


def not_accounted(agg: AggregationConfig, distfl: bool = False,
                  adaptive: AdaptiveClipConfig | None = None) -> str | None:
    """Why rounds under ``agg`` (and ``adaptive``, when enabled) get no (ε, δ) (None: they do)."""
    if adaptive is not None and adaptive.enabled:
        if adaptive.noise_multiplier <= 0.0:
            return "no DP noise (adaptive_clip.noise_multiplier = 0)"
    elif agg.noise_sigma <= 0.0:
        return "no DP noise (aggregation.noise_sigma = 0)"
    elif agg.clip_norm is None:
        return ("updates are not clipped (aggregation.clip_norm unset): the sensitivity is unbounded, so the noise "
                "gives no (epsilon, delta) guarantee")
    if agg.rule not in AVERAGING_RULES:
        return (f"aggregation.rule = {agg.rule!r} has no sensitivity bound derived here (accounted: "
                f"{', '.join(AVERAGING_RULES)})")
    if distfl:
        return ("DistFL clusters the clients by their raw, un-noised models (and publishes the clusters), which the "
                "noise does not cover")
    return None


def population_of(dp: DpConfig, data_options: Mapping[str, Any]) -> int:
    """N for the sampling rate: ``dp.population``, else ``data.options.num_clients``, else 0 (unknown)."""
    if dp.population:
        return dp.population
    n = data_options.get("num_clients", 0)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def round_mechanism(agg: AggregationConfig, metrics: Mapping[str, float], selected: int,
                    population: int, adaptive: AdaptiveClipConfig | None = None) -> RoundMechanism:
    """The round's (z, q) from its aggregation metrics: ``max_weight_share`` s_r (or ``1/num_updates`` for a plain
    mean that does not report it), ``z = σ / (S s_r)``; ``q = selected / population`` (1 when unknown).

    With ``adaptive`` enabled (its ``count_noise_std`` resolved, :func:`fedcore.adaptive_clip.resolved`), ``z`` is
    ``adaptive.noise_multiplier``, the update and the count together, after checking that the round's
    ``noise_sigma / (clip_norm · s_r)`` is the update's share ``z_Δ`` of it (ValueError otherwise)."""
    if adaptive is not None and adaptive.enabled:
        return _adaptive_mechanism(adaptive, metrics, selected, population)
    if agg.clip_norm is None or agg.noise_sigma <= 0.0:
        raise ValueError("round_mechanism: needs aggregation.clip_norm and aggregation.noise_sigma > 0")
    share = _share(agg, metrics)
    return RoundMechanism(agg.noise_sigma / (agg.clip_norm * share), _sample_rate(selected, population))


def _share(agg: AggregationConfig, metrics: Mapping[str, float]) -> float:
    share = metrics.get("max_weight_share")
    if share is None:
        n = metrics.get("num_updates", 0.0)
        if agg.weighted or n < 1:
            raise ValueError("round_mechanism: the round's metrics hold neither max_weight_share nor num_updates")
        share = 1.0 / n
    if not (0.0 < share <= 1.0):
        raise ValueError(f"round_mechanism: max_weight_share must be in (0, 1], got {share}")
    return share


def _sample_rate(selected: int, population: int) -> float:
    return min(1.0, selected / population) if population > 0 and selected > 0 else 1.0


# How far the round's noise_sigma / (clip_norm * share) may be from z_D: a few float roundings.
ADAPTIVE_RTOL = 1e-9


def _adaptive_mechanism(adaptive: AdaptiveClipConfig, metrics: Mapping[str, float], selected: int,
                        population: int) -> RoundMechanism:
    z = adaptive.noise_multiplier
    if z <= 0.0 or adaptive.count_noise_std is None:
        raise ValueError("round_mechanism: needs adaptive_clip.noise_multiplier > 0 and a resolved count_noise_std")
    clip, sigma, share = metrics.get("clip_norm"), metrics.get("noise_sigma"), metrics.get("max_weight_share")
    if clip is None or sigma is None or share is None:
        raise ValueError("round_mechanism: an adaptive-clipping round's metrics must hold clip_norm, noise_sigma and "
                         "max_weight_share")
    if not (0.0 < share <= 1.0 and math.isfinite(clip) and clip > 0.0):
        raise ValueError(f"round_mechanism: bad clip_norm {clip} or max_weight_share {share}")
    z_update = update_noise_multiplier(z, adaptive.count_noise_std)
    seen = sigma / (clip * share)
    if not math.isclose(seen, z_update, rel_tol=ADAPTIVE_RTOL):
        raise ValueError(f"round_mechanism: the round's update noise multiplier noise_sigma / (clip_norm * "
                         f"max_weight_share) = {seen:.12g} is not z_D = {z_update:.12g}")
    return RoundMechanism(z, _sample_rate(selected, population))


# ---- the accountant: pure init/update over the cumulative RDP vector ----

@dataclass(frozen=True)
class AccountantState:
    rounds: int = 0
    # The cumulative RDP at each of ORDERS (empty before the first round); may hold inf.
    rdp: tuple[float, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, strict: an infinite RDP value is written as None."""
        return {"rounds": self.rounds, "orders": list(ORDERS),
                "rdp": [v if math.isfinite(v) else None for v in self.rdp]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AccountantState:
        rdp = tuple(math.inf if v is None else float(v) for v in d.get("rdp", []))
        orders = tuple(float(o) for o in d.get("orders", ORDERS))
        if rdp and orders != ORDERS:
            raise ValueError("dp: the stored accountant state uses other RDP orders than this version")
        if rdp and len(rdp) != len(ORDERS):
            raise ValueError(f"dp: the stored accountant state has {len(rdp)} RDP values, expected {len(ORDERS)}")
        return cls(int(d.get("rounds", 0)), rdp)


def init() -> AccountantState:
    return AccountantState()


def available() -> bool:
    """Whether Opacus (the dp extra) is installed (found, not imported: importing Opacus takes seconds, which the
    first accounted round spends, in the server's worker thread)."""
    return importlib.util.find_spec("opacus") is not None


def _rdp_analysis() -> Any:
    try:
        from opacus.accountants.analysis import rdp
    except ImportError as e:
        raise RuntimeError(f"DP accounting needs Opacus: {INSTALL_HINT} ({e})") from None
    return rdp


@functools.lru_cache(maxsize=256)
def _step_rdp(q: float, z: float) -> tuple[float, ...]:
    """The RDP of one round at every order (cached: rounds of a plain mean repeat the same (q, z))."""
    rdp = _rdp_analysis().compute_rdp(q=q, noise_multiplier=z, steps=1, orders=list(ORDERS))
    return tuple(float(v) for v in rdp)


def update(state: AccountantState, mechanism: RoundMechanism) -> AccountantState:
    """``state`` after one more round of ``mechanism``."""
    rdp = _step_rdp(mechanism.sample_rate, mechanism.noise_multiplier)
    prev = state.rdp or (0.0,) * len(ORDERS)
    return AccountantState(state.rounds + 1, tuple(a + b for a, b in zip(prev, rdp, strict=True)))


def unbounded(state: AccountantState) -> AccountantState:
    """``state`` after a round whose privacy loss is not known: from then on there is no guarantee (ε = inf)."""
    return AccountantState(state.rounds + 1, (math.inf,) * len(ORDERS))


def epsilon(state: AccountantState, delta: float) -> float:
    """The ε of the (ε, δ) guarantee after ``state.rounds`` rounds (0 before any; inf when there is none)."""
    if not state.rdp:
        return 0.0
    if not any(math.isfinite(v) for v in state.rdp):
        return math.inf
    with warnings.catch_warnings():
        # Opacus warns when the optimum is at the smallest or largest order (tiny or huge noise): the value is
        # still a valid upper bound.
        warnings.simplefilter("ignore")
        eps, _ = _rdp_analysis().get_privacy_spent(orders=list(ORDERS), rdp=list(state.rdp), delta=delta)
    return float(eps)


def epsilon_after(mechanisms: Iterable[RoundMechanism], delta: float) -> float:
    """ε after running ``mechanisms`` one round each (a fold of :func:`update`)."""
    state = init()
    for m in mechanisms:
        state = update(state, m)
    return epsilon(state, delta)
