"""The secure-aggregation section: SecAgg+ graph, threshold and threat-model parameters (no torch here).

:meth:`SecureAggregationConfig.validate` raises :class:`fedcore.errors.ConfigError` naming the field. The degree k and
Shamir threshold t a round uses are chosen from these and the number of participants by
:func:`fedcore.secagg.graph.choose_parameters` (its docstring states the rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedcore.errors import require

MIN_CLIENTS = 3  # with two clients, either one learns the other's update from the sum
# The protocol's round number of a round's attempt: the round in the high bits, the attempt in the low 16.
ATTEMPT_BITS = 16


def protocol_round(round_: int, attempt: int) -> int:
    """The protocol round of ``attempt`` of federation round ``round_``: every key, share and mask is bound to it,
    so nothing of one attempt serves in another."""
    if not 0 <= attempt < (1 << ATTEMPT_BITS):
        raise ValueError(f"attempt must be in [0, {1 << ATTEMPT_BITS}), got {attempt}")
    return (round_ << ATTEMPT_BITS) | attempt


@dataclass(frozen=True)
class SecureAggregationConfig:
    """What a secure-aggregation round needs beyond the selection: every field is checked by :meth:`validate`."""

    # k, the neighbours each participant shares its secrets with and masks against: 0 = auto (the smallest even
    # degree meeting the security and correctness targets below, else the complete graph); an even k >= 2 fixes it,
    # and k >= K - 1 (K participants) means the complete graph (plain SecAgg).
    neighbours: int = 0
    # Shamir threshold as a fraction of k: t = max(t_min, ceil(threshold * k)), t_min being the smallest secure
    # threshold (more than (k + corrupt neighbours) / 2); 0 = t_min.
    threshold: float = 0.0
    # delta: the fraction of a round's participants that may drop after advertising their keys. A round whose
    # masked inputs come from fewer than K - floor(delta * K) participants is abandoned (too_many_dropouts).
    max_dropout: float = 1.0 / 3.0
    # gamma: the fraction of participants that may collude with the server (0: an honest-but-curious server that
    # may also lie about who dropped; the clients' never-both rule and t > k/2 cover that).
    corrupt_fraction: float = 0.0
    # sigma: a random graph leaks (disconnects, or gives a coalition t shares of one secret) with probability
    # at most 2^-sigma.
    security_bits: int = 40
    # eta: a round with at most the stated dropouts fails to reconstruct with probability at most 2^-eta.
    correctness_bits: int = 20
    # Fewest participants (clients that advertised keys) a round runs with.
    min_clients: int = MIN_CLIENTS
    # A client refuses to mask an update whose L2 norm exceeds this (clip first); 0 = no bound.
    norm_bound: float = 0.0
    # Each exchange phase (key advertisement, key sharing, unmasking) closes this long after it opened: whoever
    # has not answered then counts as dropped. The masked-input phase is the round's training, bounded by
    # rounds.round_timeout_s.
    phase_timeout_s: float = 30.0

    def validate(self) -> SecureAggregationConfig:
        """Refuse unusable parameters (:class:`fedcore.errors.ConfigError` naming the field); returns ``self``."""
        require(isinstance(self.neighbours, int) and self.neighbours >= 0 and self.neighbours % 2 == 0,
                "neighbours", f"must be 0 (auto) or an even integer >= 2, got {self.neighbours!r}")
        require(math.isfinite(self.threshold) and 0.0 <= self.threshold <= 1.0, "threshold",
                f"must be in [0, 1] (0 = the smallest secure threshold), got {self.threshold}")
        require(math.isfinite(self.max_dropout) and 0.0 <= self.max_dropout < 0.5, "max_dropout",
                f"must be in [0, 0.5), got {self.max_dropout}")
        require(math.isfinite(self.corrupt_fraction) and 0.0 <= self.corrupt_fraction < 0.5, "corrupt_fraction",
                f"must be in [0, 0.5), got {self.corrupt_fraction}")
        require(self.corrupt_fraction + 2.0 * self.max_dropout <= 0.9, "corrupt_fraction",
                f"corrupt_fraction + 2 * max_dropout must be <= 0.9 for any threshold to be both secure and "
                f"reachable, got {self.corrupt_fraction} + 2 * {self.max_dropout}")
        require(isinstance(self.security_bits, int) and 1 <= self.security_bits <= 128, "security_bits",
                f"must be an integer in [1, 128], got {self.security_bits!r}")
        require(isinstance(self.correctness_bits, int) and 1 <= self.correctness_bits <= 64, "correctness_bits",
                f"must be an integer in [1, 64], got {self.correctness_bits!r}")
        require(isinstance(self.min_clients, int) and self.min_clients >= MIN_CLIENTS, "min_clients",
                f"must be an integer >= {MIN_CLIENTS}, got {self.min_clients!r}")
        require(math.isfinite(self.norm_bound) and self.norm_bound >= 0.0, "norm_bound",
                f"must be a finite number >= 0 (0 = no bound), got {self.norm_bound}")
        require(math.isfinite(self.phase_timeout_s) and self.phase_timeout_s > 0, "phase_timeout_s",
                f"must be a finite number of seconds > 0, got {self.phase_timeout_s}")
        return self


# The one tensor of a masked input on the wire: 2N uint64 words sent as int64 (N = P + len(EXTRAS)).
MASKED_TENSOR = "secagg.masked"

# The extra scalars each device appends to its masked input (fedcore.secagg.aggregate): their sums give the weight
# total, the weighted sum of squared norms (w_div), the count of clipped updates and the sum of the raw norms.
EXTRAS = ("weight", "weighted_sq_norm", "clipped", "norm")


@dataclass(frozen=True)
class SecureSettings:
    """What a device learns of the server's secure aggregation when it joins (``SecureAggregationSettings`` on the
    wire): the protocol's parameters, and what the device does before masking that the server cannot do on an update
    it never sees -- clip to ``clip_norm`` (None: no clip), refuse an update over ``max_update_norm``, weight by the
    sample count when ``weighted``."""

    config: SecureAggregationConfig
    protocol: str = "secagg+"
    clip_norm: float | None = None
    weighted: bool = True
    max_update_norm: float = math.inf

    def validate(self) -> SecureSettings:
        """The announcement's values (a server's numbers are checked like a config: :class:`ConfigError`)."""
        self.config.validate()
        require(self.protocol == "secagg+", "protocol", f"unknown secure-aggregation protocol {self.protocol!r}")
        require(self.clip_norm is None or (math.isfinite(self.clip_norm) and self.clip_norm > 0), "clip_norm",
                f"must be > 0 or unset, got {self.clip_norm}")
        require(self.max_update_norm > 0, "max_update_norm", f"must be > 0, got {self.max_update_norm}")
        return self
