"""Protobuf <-> dataclass pairs in fedguard.wire: every field survives the round trip."""

from __future__ import annotations

import dataclasses
import math

import pytest

from fedcore.config import FederationInfo, TrainingConfig
from fedcore.nfl import NflSettings
from fedcore.report import DistflStatus, FederationStatus, NflStatus, RoundReport
from fedcore.serialization import SerializationError, TensorMeta
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb


def _non_default_report(round_: int) -> RoundReport:
    """A report whose every field differs from its default (so a dropped field shows)."""
    values: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(RoundReport)):
        if f.name == "round":
            values[f.name] = round_
        elif f.name == "metrics":
            values[f.name] = {"w_div": 0.25, "delta": -0.5}
        elif f.name == "clusters":
            values[f.name] = {"c0": 3, "c7": 1}
        elif isinstance(f.default, bool):
            values[f.name] = not f.default
        elif isinstance(f.default, int):
            values[f.name] = f.default + i + 1
        elif isinstance(f.default, float):
            values[f.name] = 0.125 * (i + 1) - 1.0
        else:
            values[f.name] = f"value-{i}"
    return RoundReport(**values)  # type: ignore[arg-type]


def test_every_report_field_is_on_the_wire_and_round_trips() -> None:
    proto_fields = set(pb.RoundSummary.DESCRIPTOR.fields_by_name)
    missing = {f.name for f in dataclasses.fields(RoundReport)} - proto_fields
    assert not missing, f"RoundReport fields without a RoundSummary field: {sorted(missing)}"
    r = _non_default_report(7)
    assert wire.report_from_pb(wire.report_to_pb(r)) == r
    assert RoundReport.from_dict(r.to_dict()) == r


def test_nan_fields_survive() -> None:
    back = wire.report_from_pb(wire.report_to_pb(RoundReport(round=1)))
    assert math.isnan(back.beta) and math.isnan(back.beta_hat) and back.nfl == "off"


def test_status_round_trips() -> None:
    s = FederationStatus(federation_id="f", round=3, num_rounds=9, phase="training", outcome="", clients_known=4,
                         clients_alive=3, selected=2, accepted=1, rejected=1, rejected_total=5,
                         history=(_non_default_report(1), _non_default_report(2)), finished=False,
                         resumed_from=2, stopping=True,
                         nfl=NflStatus(mode="detect-and-recover", detector="delta", state="reported", recovery=True,
                                       count=7, consecutive_ok=2, beta_hat=-0.125, delta=0.5, reported_round=6,
                                       cancelled_round=3, stopped_round=3),
                         distfl=DistflStatus(enabled=True, clustered_round=6, next_clustering=16, probe="r6",
                                             clusters={"c0": 2, "c2": 1},
                                             assignment={"a": "c0", "b": "c0", "c": "c2"}, pending=4))
    assert wire.status_from_pb(wire.status_to_pb(s)) == s


def test_training_and_federation_round_trip() -> None:
    t = TrainingConfig(local_epochs=2, batch_size=16, learning_rate=0.1, momentum=0.9, weight_decay=1e-4,
                       lr_decay=0.99, grad_clip_norm=5.0, prox_mu=0.01)
    assert wire.training_from_pb(wire.training_to_pb(t)) == t
    f = FederationInfo(federation_id="f", model_name="mlp", model_kwargs={"hidden": [8]}, model_fingerprint="ab",
                       model_spec=(TensorMeta("w", "float32", (2, 3)),), training=t, dataset="synthetic",
                       data_options={"alpha": 0.5}, num_rounds=4, seed=3,
                       chunk_bytes=4096, nfl=NflSettings("detect-and-recover", 7, 9))
    assert wire.federation_from_pb(wire.federation_to_pb(f)) == f
    # the NFL settings in one message, and the flat fields beside it for older clients
    p = wire.federation_to_pb(f)
    assert (p.nfl.mode, p.nfl.nr, p.nfl.c) == ("detect-and-recover", 7, 9)
    assert (p.nfl_mode, p.nfl_nr, p.nfl_c) == ("detect-and-recover", 7, 9)
    # an older server sent only the flat fields: they are still read
    p.ClearField("nfl")
    assert wire.federation_from_pb(p).nfl == NflSettings("detect-and-recover", 7, 9)


@pytest.mark.parametrize("raw", ["[1, 2]", "{not json"])
def test_a_malformed_json_field_is_a_serialization_error(raw: str) -> None:
    p = pb.FederationConfig(model_kwargs_json=raw)
    with pytest.raises(SerializationError, match="model_kwargs_json"):
        wire.federation_from_pb(p)


def test_the_manifest_cache_is_bounded_in_entries_and_bytes() -> None:
    """metas_from_pb caches what a remote party sends: never more than 16 manifests of at most 256 KiB each."""
    from fedcore.serialization import TensorMeta
    from fedguard import wire as w

    w._MANIFESTS.clear()
    for i in range(100):  # distinct manifests, each decoded right
        got = w.metas_from_pb(w.metas_to_pb([TensorMeta(f"t{i}", "float32", (i + 1,))]))
        assert got == [TensorMeta(f"t{i}", "float32", (i + 1,))]
        assert len(w._MANIFESTS) <= w._MANIFESTS_MAX
    w._MANIFESTS.clear()
    big = [TensorMeta("x" * 500 + str(i), "float32", (1,)) for i in range(1000)]  # ~0.5 MB on the wire
    assert w.metas_from_pb(w.metas_to_pb(big)) == big
    assert not w._MANIFESTS  # decoded, not kept
