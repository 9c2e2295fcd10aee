"""Every bad-input case answers with its gRPC status and reason, and the round goes on without it."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import torch

from fedcore.models import build_model, model_fingerprint
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import OPERATOR_MD, mark_ready, pull_model, server_config, stub, update_messages

TOKEN = "s3cret"
CASES = ["wrong_name", "wrong_shape", "wrong_dtype", "nan", "inf", "extra_bytes", "missing_bytes", "oversize",
         "oversize_message", "zero_samples", "nan_loss"]


def _bad(case: str, state: dict[str, torch.Tensor], session: str, round_: int) -> object:
    s = {k: v.clone() for k, v in state.items()}
    first = next(iter(s))
    if case == "wrong_name":
        s["bogus"] = s.pop(first)
        return update_messages(session, round_, s)
    if case == "wrong_shape":
        s[first] = torch.zeros(3, 3)
        return update_messages(session, round_, s)
    if case == "wrong_dtype":
        s[first] = s[first].double()
        return update_messages(session, round_, s)
    if case == "nan":
        s[first].view(-1)[5] = float("nan")
        return update_messages(session, round_, s)
    if case == "inf":
        s[first].view(-1)[0] = float("inf")
        return update_messages(session, round_, s)
    if case == "extra_bytes":
        return update_messages(session, round_, s, extra_bytes=b"\x00" * 16)
    if case == "missing_bytes":
        return _truncated(session, round_, s)
    if case == "oversize":
        return update_messages(session, round_, s, announce=10**12)
    if case == "oversize_message":
        return update_messages(session, round_, s, chunk=1 << 20)
    if case == "zero_samples":
        return update_messages(session, round_, s, num_samples=0)
    if case == "nan_loss":
        return update_messages(session, round_, s, train_loss=float("nan"))
    raise AssertionError(case)


def _truncated(session: str, round_: int, s: dict[str, torch.Tensor]) -> object:
    msgs = list(update_messages(session, round_, s))
    return iter(msgs[:-1])


EXPECTED = {
    "wrong_name": (grpc.StatusCode.INVALID_ARGUMENT, "missing"),
    "wrong_shape": (grpc.StatusCode.INVALID_ARGUMENT, "has shape [3, 3], expected"),
    "wrong_dtype": (grpc.StatusCode.INVALID_ARGUMENT, "has dtype float64, expected float32"),
    "nan": (grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
    "inf": (grpc.StatusCode.INVALID_ARGUMENT, "non-finite"),
    "extra_bytes": (grpc.StatusCode.INVALID_ARGUMENT, "more bytes than announced"),
    "missing_bytes": (grpc.StatusCode.INVALID_ARGUMENT, "announced bytes"),
    "oversize": (grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the limit"),
    "oversize_message": (grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    "zero_samples": (grpc.StatusCode.INVALID_ARGUMENT, "num_samples must be >= 1"),
    "nan_loss": (grpc.StatusCode.INVALID_ARGUMENT, "train_loss: must be a finite number"),
}


@pytest.fixture
def federation(tmp_path: Path):  # type: ignore[no-untyped-def]
    n = len(CASES) + 1
    cfg = server_config(tmp_path, server={"token": TOKEN, "chunk_bytes": 4096, "max_message_bytes": 8192},
                        rounds={"num_rounds": 2, "clients_per_round": n, "min_updates": 1,
                                "round_timeout_s": 60.0})
    srv = ServerThread(cfg, linger_s=0.1).start()
    ch, s = stub(srv.address)
    yield srv, s
    ch.close()
    srv.stop()


def test_each_bad_update_is_refused_with_its_status_and_the_round_goes_on(federation) -> None:  # type: ignore[no-untyped-def]
    srv, s = federation
    sessions = {}
    for name in [*CASES, "good"]:
        sessions[name] = s.Join(pb.JoinRequest(client_id=name, token=TOKEN), timeout=5).session_id
    mark_ready(s, list(sessions.values()))
    # Everyone is selected (K = number of clients): fetch round 1's model.
    header, state = pull_model(s, sessions["good"])
    assert isinstance(header, pb.TaskHeader) and header.round == 1 and state is not None
    for case in CASES:
        h, _ = pull_model(s, sessions[case])
        assert isinstance(h, pb.TaskHeader)
        code, text = EXPECTED[case]
        with pytest.raises(grpc.RpcError) as e:
            s.PushUpdate(_bad(case, state, sessions[case], 1), timeout=10)
        assert e.value.code() == code, (case, e.value.details())
        assert text in (e.value.details() or ""), (case, e.value.details())
    # The good client's update still counts and, all others having been refused, closes the round.
    assert s.PushUpdate(update_messages(sessions["good"], 1, state), timeout=10).accepted
    deadline = time.monotonic() + 10
    while not srv.coordinator.history and time.monotonic() < deadline:
        time.sleep(0.02)
    hist = srv.coordinator.history[0]
    assert hist.round == 1 and hist.accepted == 1 and hist.outcome == "all_responded"
    # gRPC's transport refuses the oversize message itself; the servicer sees a truncated update and counts it.
    assert hist.rejected == len(CASES)
    st = s.GetStatus(pb.StatusRequest(), timeout=5, metadata=OPERATOR_MD)
    assert st.history[0].rejected == len(CASES) and st.rejected_total == len(CASES)


def test_stale_unsolicited_and_unauthenticated_updates(federation) -> None:  # type: ignore[no-untyped-def]
    srv, s = federation
    sessions = {name: s.Join(pb.JoinRequest(client_id=name, token=TOKEN), timeout=5).session_id
                for name in [*CASES, "good"]}
    mark_ready(s, list(sessions.values()))
    _, state = pull_model(s, sessions["good"])
    assert state is not None
    # An unknown session.
    with pytest.raises(grpc.RpcError) as e:
        s.PushUpdate(update_messages("not-a-session", 1, state), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A round that is not the current one.
    with pytest.raises(grpc.RpcError) as e:
        s.PushUpdate(update_messages(sessions["good"], 7, state), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "current round is 1" in e.value.details()
    # A client that joined after selection was not selected.
    late = s.Join(pb.JoinRequest(client_id="latecomer", token=TOKEN), timeout=5).session_id
    with pytest.raises(grpc.RpcError) as e:
        s.PushUpdate(update_messages(late, 1, state), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not selected" in e.value.details()
    # Accepted once; a second upload for the same round is refused as a copy of what the round holds (a device that
    # resent it, not knowing it had arrived), and not counted as a refused update.
    assert s.PushUpdate(update_messages(sessions["good"], 1, state), timeout=10).accepted
    with pytest.raises(grpc.RpcError) as e:
        s.PushUpdate(update_messages(sessions["good"], 1, state), timeout=10)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already accepted" in e.value.details()
    assert "good" not in srv.call(lambda: dict(srv.coordinator.state.rejected))
    # A stream that does not start with a header.
    with pytest.raises(grpc.RpcError) as e:
        s.PushUpdate(iter([pb.UpdateMessage(chunk=pb.Chunk(offset=0, data=b"x"))]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start with its header" in e.value.details()
    # A manifest with an unknown dtype code / inconsistent byte count.
    hdr = pb.UpdateHeader(session_id=sessions[CASES[0]], round=1, num_samples=1, kind=pb.WEIGHTS,
                          tensors=[pb.TensorMeta(name="x", dtype=77, shape=[2], nbytes=8)], total_bytes=8)
    with pytest.raises(grpc.RpcError) as e:
        s.PushUpdate(iter([pb.UpdateMessage(header=hdr)]), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown dtype" in e.value.details()
    # Nothing of this reached the model: the round still waits for the others.
    assert srv.coordinator.state.accepted == ["good"]


def test_join_refuses_bad_token_bad_id_and_mismatched_model(federation) -> None:  # type: ignore[no-untyped-def]
    _, s = federation
    with pytest.raises(grpc.RpcError) as e:
        s.Join(pb.JoinRequest(client_id="a", token="wrong"), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as e:
        s.Join(pb.JoinRequest(client_id="", token=TOKEN), timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fp = model_fingerprint(build_model("mlp", {"hidden": [7]}))
    with pytest.raises(grpc.RpcError) as e:
        s.Join(pb.JoinRequest(client_id="a", token=TOKEN, model_fingerprint=fp), timeout=5)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "does not match" in e.value.details()
    ok = s.Join(pb.JoinRequest(client_id="a", token=TOKEN,
                               model_fingerprint=model_fingerprint(build_model("mlp"))), timeout=5)
    assert ok.session_id and ok.config.model_name == "mlp"
