"""What a client reports with its update besides the tensors: one frozen, typed :class:`UpdateReport`.

Why one record: these numbers used to travel as a string-keyed map (``"test_accuracy"``, ``"adapting"``, ...) written
in ``fedclient`` and read by name on the server, so renaming a key on one side turned β into NaN with no error, and
β̂ᵢ changed record type six times between the device and the detector. Now the client's round
(:mod:`fedclient.local_round`) builds an :class:`UpdateReport`, the wire carries it as the ``UpdateReport`` message
of ``protos/fedguard/v1/fedguard.proto`` (one serde pair, :func:`fedguard.wire.update_report_to_pb` /
:func:`fedguard.wire.update_report_from_pb`), and the server's intake, the round report, the NFL detector's median
and the client's own :class:`fedcore.client_state.ClientRoundReport` read its fields -- a misspelt field is an
``AttributeError`` and a mypy error, not a silent NaN.

**β̂ᵢ has one type from device to detector**, :data:`BetaHat` (``float | None``): the client's estimated gain
β̂ᵢ = EV(model, b_iʳ) − Pᵢ (FL-GUARD Eq. 3), ``None`` when it has none (no private model, so no Pᵢ). The client's
measure, :attr:`UpdateReport.beta_hat`, the individual-level measures' observation and the detector's observation
(:class:`fedcore.nfl.NflObservation`, the round median) all hold it as that type; only the persisted round row
(:class:`fedcore.report.RoundReport`, ``rounds.jsonl``) writes "none" as NaN.

**Extras.** Numbers a recovery method or an attack reports beside the protocol's fields (LINDT's ``lindt_global_ce``,
KD's ``kd_ce``, ``attack_gamma``, ...) go in :attr:`UpdateReport.extras`, a separate namespace: a key may not be a
field's name, so a method can never shadow a protocol number, and by convention each key starts with its producer
(``lindt_``, ``kd_``, ``personal_``, ``attack_``). The server bounds them and keeps them out of every decision: a
number the server acts on is a field here, never an extra (a test walks the server's code for string-keyed reads).

**Bounds.** The server never trusts a client's numbers: :meth:`UpdateReport.bounds_error` names the first field
out of its range (counts >= 1, finite numbers, accuracies in [0, 1], β̂ᵢ in [-1, 1], seconds and passes >= 0) and the
intake refuses the update with that reason; ``fedserver.bounds`` caps the wire's sizes before that.

**Old clients.** A client from before the ``UpdateReport`` message sends ``num_samples``, ``train_loss``, ``beta_hat``
and the ``metrics`` map in the update header; :func:`from_metrics_map` reads that into an :class:`UpdateReport`
(the wire stays version 1, backward-readable). :meth:`UpdateReport.as_metrics` is the same map the other way, for the
client's per-round history (``ClientSummary.history``) and logs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeAlias

# β̂ᵢ (FL-GUARD Eq. 3) as measured by a client, sent with its update and observed by the detectors; None: the client
# has no β̂ᵢ (no private model, so no Pᵢ).
BetaHat: TypeAlias = float | None

# The metrics-map key of the measured β̂ᵢ in :meth:`UpdateReport.as_metrics` views (and in old clients' maps).
MEASURED_BETA_HAT_KEY = "beta_hat_measured"


@dataclass(frozen=True, kw_only=True)
class UpdateReport:
    """Everything a client reports with one update (the tensors aside). ``None`` in an optional field: not measured.

    ``num_samples``: the local training samples (the update's FedAvg weight); ``train_loss``: the round's mean
    training loss; ``beta_hat``: the β̂ᵢ sent (:data:`BetaHat`; a fabricated-β̂ attacker's differs from its measure);
    ``test_accuracy``/``test_loss``: the model the client infers with, on its whole local test split (Vᵢ);
    ``private_accuracy``: Pᵢ, its private model's accuracy; ``adapting``: the round ran the recovery method;
    ``infers_adapted``: the round's inference model was the adapted/personal vᵢ; ``train_seconds``: the round's
    local compute time; ``passes``: forward/backward passes relative to vanilla training (1.0 = vanilla, FL-GUARD
    adaptation 2.0); ``extras``: the method's and attack's own numbers (module docstring)."""

    num_samples: int
    train_loss: float
    beta_hat: BetaHat = None
    test_accuracy: float | None = None
    test_loss: float | None = None
    private_accuracy: float | None = None
    adapting: bool = False
    infers_adapted: bool = False
    train_seconds: float = 0.0
    passes: float = 1.0
    extras: Mapping[str, float] = field(default_factory=dict)

    def bounds_error(self) -> str | None:
        """The first field out of its range, as a reason naming it (what the server refuses the update with), or
        None when every number is plausible."""
        if self.num_samples < 1:
            return f"num_samples must be >= 1, got {self.num_samples}"
        if not math.isfinite(self.train_loss):
            return f"train_loss must be finite, got {self.train_loss}"
        if self.beta_hat is not None:
            if not math.isfinite(self.beta_hat):
                return f"beta_hat must be finite, got {self.beta_hat}"
            if not -1.0 <= self.beta_hat <= 1.0:
                return f"beta_hat must be in [-1, 1] (a difference of two accuracies), got {self.beta_hat}"
        for name in ("test_accuracy", "private_accuracy"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:  # NaN fails too
                return f"{name} must be in [0, 1] (an accuracy), got {value}"
        for name in ("test_loss", "train_seconds", "passes"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0.0):
                return f"{name} must be a finite number >= 0, got {value}"
        for key, value in self.extras.items():
            if key in _FIELDS:
                return f"extras[{key!r}] has the name of a field (extras never shadow the protocol's numbers)"
            if not math.isfinite(value):
                return f"extras[{key!r}] must be finite, got {value}"
        return None

    def as_metrics(self) -> dict[str, float]:
        """The report as the flat name -> number map an old client sent (the inverse of :func:`from_metrics_map`
        beside the header's scalars): the measured optional fields, the flags as 0.0/1.0, the extras; for the
        client's per-round history and logs, never read back by the server."""
        m: dict[str, float] = {}
        for name in _MAP_FIELDS:
            value = getattr(self, name)
            if value is not None:
                m[name] = float(value)
        return {**m, **self.extras}


_FIELDS = frozenset(f.name for f in dataclasses.fields(UpdateReport))
# The fields that an old client's ``metrics`` map carried under their own names (the header had the rest).
_MAP_FIELDS = ("test_accuracy", "test_loss", "private_accuracy", "adapting", "infers_adapted", "train_seconds",
               "passes")


def from_metrics_map(num_samples: int, train_loss: float, beta_hat: BetaHat,
                     metrics: Mapping[str, float]) -> UpdateReport:
    """The report of an old client's update header (its scalars and its ``metrics`` map): the map's entries named
    like a field fill that field (a flag is set above 0.5, absent ``passes`` is vanilla's 1.0); the measured β̂ᵢ it
    sent for itself is dropped; every other entry is an extra."""
    m = dict(metrics)
    extras = {k: float(v) for k, v in m.items() if k not in _MAP_FIELDS and k != MEASURED_BETA_HAT_KEY}
    return UpdateReport(
        num_samples=num_samples, train_loss=train_loss, beta_hat=beta_hat,
        test_accuracy=m.get("test_accuracy"), test_loss=m.get("test_loss"),
        private_accuracy=m.get("private_accuracy"),
        adapting=m.get("adapting", 0.0) > 0.5, infers_adapted=m.get("infers_adapted", 0.0) > 0.5,
        train_seconds=m.get("train_seconds", 0.0), passes=m.get("passes", 1.0), extras=extras)


__all__ = ["MEASURED_BETA_HAT_KEY", "BetaHat", "UpdateReport", "from_metrics_map"]
