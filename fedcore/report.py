"""The typed per-round report: one :class:`RoundReport` is produced when a round completes and every consumer
(the ``rounds.jsonl`` writer, GetStatus, the launcher's table, the state store, later the NFL detectors)
reads that one object instead of string-keyed dicts.

Its dict form (:meth:`RoundReport.to_dict`) is the ``rounds.jsonl`` row: the scalar fields at the top level and
the aggregation pipeline's metrics under ``"metrics"``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcore.jsonio import number

NAN = float("nan")


@dataclass(frozen=True)
class RoundReport:
    round: int
    # Which attempt of the round completed (0 unless earlier attempts were abandoned).
    attempt: int = 0
    selected: int = 0
    accepted: int = 0
    # Updates refused while this round was current, solicited or not (abandoned attempts' not counted) ...
    rejected: int = 0
    # Uploads refused because their round (or attempt) had already closed (late stragglers), since the federation
    # began (a running total, so none is lost between two reports).
    late_total: int = 0
    # Accepted updates of this round from clients that joined as attackers (simulation; their test accuracy and
    # beta are left out of the *_benign numbers).
    attackers: int = 0
    # Sample-weighted mean of the clients' reported training losses.
    mean_train_loss: float = NAN
    # Mean over participants of the received model's accuracy on their local test split.
    mean_test_accuracy: float = NAN
    test_accuracy_benign: float = NAN
    # The new global model on the pooled test set (NaN unless evaluation.central).
    central_accuracy: float = NAN
    # FL-GUARD Eq. 1-2 over the participants that report P_i (NaN when none does).
    beta: float = NAN
    beta_weighted: float = NAN
    beta_benign: float = NAN
    beta_benign_weighted: float = NAN
    # FL-GUARD Eq. 3: median of the round's reported beta_hat_i (UpdateReport.beta_hat; NaN when none was reported)
    beta_hat: float = NAN
    # ... and the detector's beta_hat: the mean of the last c round medians (NaN before any).
    beta_hat_avg: float = NAN
    # How well the cheap beta_hat_i (first batch) tracks beta_i (full local test split): mean |beta_hat_i - beta_i|
    # over the participants that report both.
    beta_hat_error: float = NAN
    # Participants whose inference model is their adapted model v_i (they report it), and opt-out holdouts.
    adapting: int = 0
    holdouts: int = 0
    # beta over the benign participants that are not holdouts, and over the benign holdouts (FL-GUARD §5.4).
    beta_adapting: float = NAN
    beta_holdout: float = NAN
    # The same two groups' mean local test accuracy of the model each client infers with (benign clients).
    test_accuracy_adapting: float = NAN
    test_accuracy_holdout: float = NAN
    # The participants' local training seconds, summed (client compute; UpdateReport.train_seconds of each update).
    client_seconds: float = 0.0
    # The participants' forward/backward passes relative to vanilla training of the round, averaged (1.0 =
    # vanilla; FL-GUARD adaptation 2.0; UpdateReport.passes of each update, 1.0 when its trainer reports none).
    client_passes: float = NAN
    # The NFL detector after this round: "off", "always" (always-recover), "watching" or "reported"; its
    # count (negative beta_hat rounds since the last cancel, or rounds with delta > epsilon); whether the next
    # round's tasks carry recovery.
    nfl: str = "off"
    nfl_count: int = 0
    recovery: bool = False
    # Wall seconds from the round's first start to its report.
    seconds: float = 0.0
    # Why the round closed: "quorum", "all_responded" or "deadline".
    outcome: str = ""
    # The aggregation pipeline's metrics (num_updates, w_div, delta, norms, ...).
    metrics: Mapping[str, float] = field(default_factory=dict)
    # DistFL (SPEC §8): cluster id -> number of clients in it after this round (empty when DistFL is off or
    # before the first clustering).
    clusters: Mapping[str, int] = field(default_factory=dict)
    # Server-side DP (fedcore.privacy, docs/privacy.md): the cumulative epsilon of the (epsilon, delta) guarantee
    # after this round (Opacus' RDP accountant), its delta, and this round's noise multiplier z (noise std over
    # the aggregate's L2 sensitivity) and sampling rate q. NaN when the round is not accounted (DP off, a rule
    # without a sensitivity bound, or the dp extra not installed).
    dp_epsilon: float = NAN
    dp_delta: float = NAN
    dp_noise_multiplier: float = NAN
    dp_sample_rate: float = NAN
    # The update bytes the server took this round: the tensor payload (UpdateHeader.total_bytes) of every accepted
    # update, whatever its kind (weights, a compressed update, a masked input; headers and framing not counted).
    bytes_received: int = 0
    # Wall seconds from the server's start (this process's: a resumed server counts from its restart) to this
    # round's report: time-to-accuracy reads it.
    wall_seconds: float = NAN
    # Buffered rounds (rounds.mode = "buffered"): the spread of the buffer's staleness (rounds between the model
    # each update was trained from and this round); NaN in sync rounds.
    staleness_min: float = NAN
    staleness_mean: float = NAN
    staleness_max: float = NAN

    def to_dict(self) -> dict[str, Any]:
        """The ``rounds.jsonl`` row; NaN stays a float here: :func:`fedcore.jsonio.dumps` writes it as ``null``.
        ``dataclasses.asdict``'s dict (a subclass's fields too, every mapping copied), read field by field: asdict's
        recursion costs ~6x as much (about 40 us a call, twice a round on the server)."""
        d = {name: getattr(self, name) for name in _field_names(type(self))}
        for name, value in d.items():
            if isinstance(value, Mapping):
                d[name] = dict(value)
        d["metrics"] = {k: float(v) for k, v in self.metrics.items()}
        d["clusters"] = {str(k): int(v) for k, v in self.clusters.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RoundReport:
        """The report of a ``to_dict`` row; unknown keys (rows of a newer version) are ignored, and ``null`` (strict
        JSON's form of NaN) reads back as NaN."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: (math.nan if v is None and k in _FLOAT_FIELDS else v)
                                  for k, v in d.items() if k in names}
        kwargs["metrics"] = {str(k): number(v) for k, v in dict(d.get("metrics", {})).items()}
        kwargs["clusters"] = {str(k): int(v) for k, v in dict(d.get("clusters", {})).items()}
        return cls(**kwargs)

    def scalars(self) -> dict[str, float]:
        """Every numeric field beside the aggregation metrics (for flat metric maps and log lines)."""
        return {f.name: float(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("round", "outcome", "nfl", "metrics", "clusters")}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type[RoundReport]) -> tuple[str, ...]:
    """The dataclass fields of ``cls`` (RoundReport or a subclass), in order; looked up once per class."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


_FLOAT_FIELDS = frozenset(f.name for f in dataclasses.fields(RoundReport) if f.type in ("float", float))


def row_from_json(d: Mapping[str, Any]) -> dict[str, Any]:
    """A ``rounds.jsonl`` row as read with :func:`json.loads`, with strict JSON's ``null`` of a number field (and of
    a metric) back to NaN, so code written for the NaN rows of older files reads both."""
    out: dict[str, Any] = {k: (math.nan if v is None and k in _FLOAT_FIELDS else v) for k, v in d.items()}
    metrics = out.get("metrics")
    if isinstance(metrics, Mapping):
        out["metrics"] = {str(k): number(v) for k, v in metrics.items()}
    return out


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values) if values else NAN


def median(values: list[float]) -> float:
    """The median (the mean of the two middle values for an even count); NaN when empty."""
    if not values:
        return NAN
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


@dataclass(frozen=True)
class NflStatus:
    """The server's NFL detector as GetStatus shows it (``state``: off, always, watching or reported)."""

    mode: str = "off"
    detector: str = "beta_hat"
    state: str = "off"
    recovery: bool = False
    count: int = 0
    consecutive_ok: int = 0
    # The running beta_hat (mean of the last c round medians) and the latest delta; NaN before the first.
    beta_hat: float = NAN
    delta: float = NAN
    # Rounds of the latest report, cancel and recovery stop (0: never).
    reported_round: int = 0
    cancelled_round: int = 0
    stopped_round: int = 0


@dataclass(frozen=True)
class DistflStatus:
    """DistFL's clusters as GetStatus shows them (SPEC §8): ``clusters`` maps cluster id -> size,
    ``assignment`` client id -> cluster id; ``pending``: clients seen since the first clustering that have no
    cluster yet (they are handed the global model); ``probe``: the synthetic input set responses are computed on
    (empty before the first clustering)."""

    enabled: bool = False
    clustered_round: int = 0
    next_clustering: int = 0
    probe: str = ""
    clusters: Mapping[str, int] = field(default_factory=dict)
    assignment: Mapping[str, str] = field(default_factory=dict)
    pending: int = 0


@dataclass(frozen=True)
class FederationStatus:
    """Where a federation stands (GetStatus, the server's return value)."""

    federation_id: str
    round: int
    num_rounds: int
    phase: str
    outcome: str
    clients_known: int
    clients_alive: int
    selected: int
    accepted: int
    rejected: int
    rejected_total: int
    history: tuple[RoundReport, ...]
    finished: bool
    # Rounds completed when this server process restored the federation from its state store (0: a new one).
    resumed_from: int = 0
    # A stop was requested (SIGTERM/SIGINT): no more updates are taken; the next start resumes.
    stopping: bool = False
    nfl: NflStatus = field(default_factory=NflStatus)
    distfl: DistflStatus = field(default_factory=DistflStatus)
