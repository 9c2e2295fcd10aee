"""The server's request gate in isolation: stream limits, field bounds, certificate identities."""

from __future__ import annotations

import math

import pytest

from fedguard.v1 import fedguard_pb2 as pb
from fedserver import bounds
from fedserver.auth import Authenticator, certificate_identity
from fedserver.errors import ProtocolError
from fedserver.limits import StreamLimits


def test_one_upload_and_one_pull_per_session_and_a_byte_ceiling() -> None:
    limits = StreamLimits(max_buffered_bytes=100)
    with limits.upload("a", 60):
        assert limits.buffered == 60 and limits.uploads_in_flight == 1
        with pytest.raises(ProtocolError, match="already in flight") as e, limits.upload("a", 1):
            pass
        assert e.value.code == "RESOURCE_EXHAUSTED"
        with pytest.raises(ProtocolError, match="buffering 60 bytes"), limits.upload("b", 41):
            pass
        with limits.upload("b", 40):
            assert limits.buffered == 100
    assert limits.buffered == 0 and limits.uploads_in_flight == 0
    with pytest.raises(RuntimeError), limits.upload("a", 10):  # released on any exit
        raise RuntimeError
    assert limits.buffered == 0
    with limits.pull("a"), pytest.raises(ProtocolError, match="pull is already in flight"), limits.pull("a"):
        pass
    with limits.pull("a"):
        pass


@pytest.mark.parametrize("header", [
    pb.UpdateHeader(session_id="s", train_loss=math.nan),
    pb.UpdateHeader(session_id="s", train_loss=1e300),
    pb.UpdateHeader(session_id="s", num_samples=1 << 50),
    pb.UpdateHeader(session_id="s", round=1 << 50),
    pb.UpdateHeader(session_id="s", metrics={"x": math.inf}),
    pb.UpdateHeader(session_id="s", metrics={"bad name!": 1.0}),
    pb.UpdateHeader(session_id="s", metrics={f"m{i}": 1.0 for i in range(100)}),
    pb.UpdateHeader(session_id="s", payload_sha256=b"short"),
    pb.UpdateHeader(session_id="s" * 100),
    pb.UpdateHeader(session_id="s", report=pb.UpdateReport(train_loss=math.nan)),
    pb.UpdateHeader(session_id="s", report=pb.UpdateReport(num_samples=1 << 50)),
    pb.UpdateHeader(session_id="s", report=pb.UpdateReport(num_samples=1, test_loss=1e300)),
    pb.UpdateHeader(session_id="s", report=pb.UpdateReport(num_samples=1, beta_hat=math.inf)),
    pb.UpdateHeader(session_id="s", report=pb.UpdateReport(extras={"bad name!": 1.0})),
    pb.UpdateHeader(session_id="s", report=pb.UpdateReport(extras={f"m{i}": 1.0 for i in range(100)})),
])
def test_absurd_update_headers_are_refused_naming_the_field(header: pb.UpdateHeader) -> None:
    with pytest.raises(ProtocolError) as e:
        bounds.check_update_header(header)
    assert e.value.code == "INVALID_ARGUMENT" and ":" in e.value.message
    bounds.check_update_header(pb.UpdateHeader(session_id="s", num_samples=10, train_loss=0.5,
                                               metrics={"test_accuracy": 0.9, "lambda.mean": 0.1}))
    bounds.check_update_header(pb.UpdateHeader(session_id="s", report=pb.UpdateReport(
        num_samples=10, train_loss=0.5, beta_hat=-0.25, test_accuracy=0.9, extras={"lambda.mean": 0.1})))


REPORT_DOUBLES = [f.name for f in pb.UpdateReport.DESCRIPTOR.fields if f.type == f.TYPE_DOUBLE]


@pytest.mark.parametrize("name", REPORT_DOUBLES)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300, -1e300])
def test_every_number_of_an_update_report_is_bounded_naming_its_field(name: str, value: float) -> None:
    """Each double of UpdateReport (taken from the message's descriptor: a field added later is covered): a
    non-finite or absurd value is refused naming ``report.<field>``; finite ones in range, and absent optional
    ones, pass."""
    assert {"train_loss", "beta_hat", "test_accuracy", "test_loss", "private_accuracy", "train_seconds",
            "passes"} <= set(REPORT_DOUBLES)
    with pytest.raises(ProtocolError) as e:
        bounds.check_update_report(pb.UpdateReport(num_samples=1, **{name: value}))
    assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith(f"report.{name}:"), e.value.message
    bounds.check_update_report(pb.UpdateReport(num_samples=1, **{name: -0.5}))
    bounds.check_update_report(pb.UpdateReport(num_samples=1))


def test_certificate_identity_prefers_the_fedguard_uri() -> None:
    ctx = {"x509_subject_alternative_name": [b"DNS:x", b"urn:fedguard:client:alice"], "x509_common_name": [b"bob"]}
    assert certificate_identity(ctx) == "alice"
    assert certificate_identity({"x509_common_name": [b"bob"]}) == "bob"
    assert certificate_identity({}) is None
    Authenticator.require(None, "anyone", "x")
    Authenticator.require("alice", "alice", "x")
    with pytest.raises(ProtocolError) as e:
        Authenticator.require("alice", "bob", "this session")
    assert e.value.code == "PERMISSION_DENIED"


def test_an_upload_admitted_before_the_round_restarted_is_not_counted_against_the_new_attempt() -> None:
    from fedcore import rounds as rm
    from fedcore.config import ServerConfig
    from fedcore.models import build_model, model_manifest
    from fedcore.update_report import UpdateReport
    from fedserver.global_models import GlobalModels
    from fedserver.intake import UpdateIntake

    model = build_model("mlp")
    state = rm.RoundState(round=1, attempt=0, phase=rm.TRAINING, selected=["a"])
    seen: list[rm.Observation] = []
    intake = UpdateIntake(ServerConfig(), GlobalModels.of(model), lambda: state, seen.append, lambda: 0.0,
                          lambda cid: "global")
    intake.open_round(1, 0, 1, 0.0)
    ticket = intake.begin("a", 1, UpdateReport(num_samples=10, train_loss=0.5), False, model_manifest(model), 0)
    assert ticket.attempt == 0
    state.attempt = 1  # the round was abandoned and re-run while the upload was in flight
    with pytest.raises(ProtocolError, match="truncated"):
        intake.reject_ticket(ticket, "INVALID_ARGUMENT", "truncated")
    assert not seen  # not recorded: "a" may still send its update for attempt 1
    state.attempt = 0
    with pytest.raises(ProtocolError):
        intake.reject_ticket(ticket, "INVALID_ARGUMENT", "truncated")
    assert isinstance(seen[0], rm.UpdateRejected)
