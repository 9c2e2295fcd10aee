"""Secure aggregation (SecAgg+) over real gRPC on loopback: the server learns only the sum, the global model is
bit-identical to plain FedAvg's, a device may vanish at any phase after advertising its keys, and the protocol's
messages are checked (a share for another round, an advertisement for another client: refused)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedclient import ClientConfig, FedClient
from fedclient import secure as client_secure
from fedcore.serialization import load_state
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from fedserver import servicer as servicer_module
from fedserver.secure_round import SecureRounds
from tests.integration.helpers import join_session, mark_ready, pull_model, server_config, stub

K = 6
# χ² with 255 degrees of freedom: P(χ² > 330.5) = 0.001 for uniform bytes.
CHI2_CRITICAL = 330.5


def _config(tmp_path: Path, secure: bool, rounds: int = 2, **aggregation: Any) -> Any:
    agg: dict[str, Any] = {"secure": "secagg+" if secure else "off", **aggregation}
    return server_config(tmp_path, rounds={"num_rounds": rounds, "clients_per_round": K, "round_timeout_s": 30.0},
                         aggregation=agg, secagg={"phase_timeout_s": 3.0}, training={"local_epochs": 1})


def _run(config: Any, timeout: float = 180.0) -> tuple[Any, list[BaseException | None]]:
    """Serve ``config`` with K embedded clients; the final status and each client's error (None: it finished)."""
    srv = ServerThread(config, linger_s=1.0).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=5.0)).start() for i in range(K)]
    status = srv.wait(timeout)
    errors: list[BaseException | None] = []
    for c in clients:
        try:
            c.join(30)
            errors.append(None)
        except Exception as e:  # a test device that vanished re-raises its own error
            errors.append(e)
    return status, errors


def _final(tmp_path: Path) -> dict[str, torch.Tensor]:
    state, _ = load_state(tmp_path / "run" / "final_model.fgt")
    return state


def _chi_square(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).astype(np.float64)
    expected = len(data) / 256
    return float(((counts - expected) ** 2 / expected).sum())


def test_secure_federation_is_bit_identical_and_the_server_sees_no_update(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Server-side DP's clip (on the devices) and noise (on the server, after unmasking), weighted FedAvg.
    dp = {"clip_norm": 0.5, "noise_sigma": 0.001}
    status, errors = _run(_config(tmp_path / "plain", False, **dp))
    assert status.outcome == "completed" and errors == [None] * K
    plain = _final(tmp_path / "plain")

    received: list[bytes] = []  # every message the server process decodes
    decoder = servicer_module._decoder

    def recording(cls: Any) -> Callable[[bytes], Any]:
        decode = decoder(cls)

        def record(data: bytes) -> Any:
            received.append(bytes(data))
            return decode(data)
        return record

    monkeypatch.setattr(servicer_module, "_decoder", recording)
    masked: list[np.ndarray[Any, Any]] = []
    take = SecureRounds.take_masked

    def take_recording(self: SecureRounds, client_id: str, round_: int, attempt: int, vector: Any) -> None:
        masked.append(vector.copy())
        take(self, client_id, round_, attempt, vector)

    monkeypatch.setattr(SecureRounds, "take_masked", take_recording)
    plain_inputs: list[tuple[torch.Tensor, np.ndarray[Any, Any]]] = []  # what the devices masked
    prepare = client_secure.prepare_input

    def prepare_recording(update: torch.Tensor, num_samples: float, settings: Any) -> Any:
        words = prepare(update, num_samples, settings)
        plain_inputs.append((update.clone(), words.copy()))
        return words

    monkeypatch.setattr(client_secure, "prepare_input", prepare_recording)

    status, errors = _run(_config(tmp_path / "secure", True, **dp))
    assert status.outcome == "completed" and errors == [None] * K
    secure = _final(tmp_path / "secure")
    assert plain.keys() == secure.keys()
    for name in plain:
        assert plain[name].numpy().tobytes() == secure[name].numpy().tobytes(), name

    history = status.history
    assert [h.accepted for h in history] == [K, K]
    assert all(h.metrics["secagg_survivors"] == K and h.metrics["secagg_dropped"] == 0 for h in history)
    assert all(math.isfinite(h.metrics["w_div"]) and math.isfinite(h.metrics["delta"]) for h in history)

    # The server's inputs: no device's update (nor its encoded plain input) appears in any message it received, and
    # each masked input it summed is indistinguishable from uniform bytes.
    assert len(plain_inputs) == 2 * K and len(masked) == 2 * K
    wire_bytes = b"".join(received)
    for update, words in plain_inputs:
        assert update.numpy().tobytes()[:256] not in wire_bytes
        assert words.tobytes()[:256] not in wire_bytes
        assert words.tobytes()[-256:] not in wire_bytes
    chi2 = [_chi_square(v.tobytes()) for v in masked]
    assert max(chi2) < CHI2_CRITICAL, chi2
    # ... while a plain input is far from uniform (the test can fail).
    assert _chi_square(plain_inputs[0][1].tobytes()) > 10 * CHI2_CRITICAL


class Vanished(Exception):
    """The test's device crashes here (its thread ends: no more heartbeats, no answer)."""


@pytest.mark.parametrize("phase", ["advertisement", "shares", "masked", "unmask"])
def test_a_device_vanishing_at_any_phase_leaves_a_correct_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                phase: str) -> None:
    victim = "client-3"
    next_step = client_secure.SecureClient._next
    masked_input = client_secure.SecureClient.masked_input

    def vanishing_next(self: client_secure.SecureClient, r: Any, req: pb.SecAggRequest, want: str) -> Any:
        if self.client_id == victim and r.round == 1 and req.WhichOneof("kind") == phase:
            raise Vanished(f"{victim} vanished before its {phase} message")
        return next_step(self, r, req, want)

    def vanishing_mask(self: client_secure.SecureClient, r: Any, *args: Any) -> Any:
        if self.client_id == victim and r.round == 1 and phase == "masked":
            raise Vanished(f"{victim} vanished before its masked input")
        return masked_input(self, r, *args)

    monkeypatch.setattr(client_secure.SecureClient, "_next", vanishing_next)
    monkeypatch.setattr(client_secure.SecureClient, "masked_input", vanishing_mask)
    status, errors = _run(_config(tmp_path, True, rounds=1))
    assert status.outcome == "completed"
    assert [e is not None for e in errors] == [i == 3 for i in range(K)]
    (round1,) = status.history
    assert round1.attempt == 0  # not re-run: one device of six may drop (at most a third)
    # A device lost before its masked input is not in the sum; one lost after it is (only its reveals are missing).
    in_sum = K if phase == "unmask" else K - 1
    assert round1.accepted == in_sum and round1.metrics["secagg_survivors"] == in_sum
    assert round1.metrics["num_updates"] == in_sum
    assert round1.metrics["secagg_dropped"] == 1
    assert round1.rejected == (0 if phase == "unmask" else 1)


def test_too_many_dropouts_re_run_the_round_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    victims = {"client-1", "client-2", "client-3"}  # three of six: more than a third
    next_step = client_secure.SecureClient._next
    gone: set[str] = set()
    lock = threading.Lock()

    def vanishing_next(self: client_secure.SecureClient, r: Any, req: pb.SecAggRequest, want: str) -> Any:
        if self.client_id in victims and req.WhichOneof("kind") == "shares":
            with lock:
                first = self.client_id not in gone
                gone.add(self.client_id)
            if first:
                raise client_secure.SecureRoundAbandoned("the test's device leaves the round")
        return next_step(self, r, req, want)

    monkeypatch.setattr(client_secure.SecureClient, "_next", vanishing_next)
    config = _config(tmp_path, True, rounds=1)
    status, errors = _run(config)
    assert status.outcome == "completed" and errors == [None] * K
    (round1,) = status.history
    assert round1.attempt == 1 and round1.metrics["secagg_survivors"] == K  # the re-run had everyone
    abandoned = [r.getMessage() for r in caplog.records if "round.abandoned" in r.getMessage()]
    assert len(abandoned) == 1 and "too_many_dropouts in phase share" in abandoned[0], abandoned


def test_a_server_stall_in_an_exchange_phase_drops_no_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """The server's loop is held up 5 s -- longer than ``secagg.phase_timeout_s`` (3 s) -- while a key-exchange phase
    of round 1 still waits for devices, and the phase's deadline is judged right after. The stall counts against no
    phase: nobody is dropped, the round is not re-run, and the stall is logged."""
    from fedcore.secagg import protocol as sp
    from fedserver.coordinator import Coordinator

    held: list[str] = []
    reap = Coordinator._reap_close

    def reap_then_stall(self: Coordinator) -> None:  # the run loop's step just before it judges the phase deadline
        reap(self)
        s = self.secure.state
        waiting = s is not None and self.secure.round == 1 and (
            (s.phase == sp.ADVERTISE and len(s.advertisements) < len(s.selected))
            or (s.phase == sp.SHARE and len(s.shares) < len(s.participants)))
        if waiting and not held and s is not None:
            held.append(s.phase)
            time.sleep(5.0)  # blocks the event loop: no device's message is read meanwhile

    monkeypatch.setattr(Coordinator, "_reap_close", reap_then_stall)
    status, errors = _run(_config(tmp_path, True, rounds=1))
    assert held, "the loop never found a phase waiting for devices: nothing was tested"
    assert status.outcome == "completed" and errors == [None] * K
    (round1,) = status.history
    assert (round1.attempt, round1.accepted) == (0, K)
    assert round1.metrics["secagg_survivors"] == K and round1.metrics["secagg_dropped"] == 0
    stalls = [r.getMessage() for r in caplog.records if "server.stalled" in r.getMessage()]
    assert stalls, f"no stall logged (held in phase {held[0]})"


def test_protocol_messages_are_bound_to_the_round_and_the_session(tmp_path: Path) -> None:
    config = _config(tmp_path, True, rounds=1)
    srv = ServerThread(config, linger_s=0.5).start()
    ch, s = stub(srv.address)
    try:
        token = config.server.token
        sessions = [join_session(s, f"dev-{i}", token) for i in range(K)]
        mark_ready(s, sessions)
        header, _ = pull_model(s, sessions[0])
        assert isinstance(header, pb.TaskHeader) and header.round == 1
        from fedcore.secagg import protocol as sp
        from fedcore.secagg.config import protocol_round
        from fedguard import wire

        _, adv = sp.client_advertise(config.server.federation_id, protocol_round(1, int(header.attempt)), "dev-1",
                                     lambda m: b"")
        forged = pb.SecAggRequest(session_id=sessions[0], round=1, attempt=header.attempt,
                                  advertisement=wire.advertisement_to_pb(adv))
        import grpc
        with pytest.raises(grpc.RpcError) as err:
            s.SecureAggregate(forged, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "forged" in err.value.details()
        wrong_round = pb.SecAggRequest(session_id=sessions[0], round=2, attempt=header.attempt,
                                       shares=pb.SecAggShares(commitment=b"x" * 32))
        with pytest.raises(grpc.RpcError) as err:
            s.SecureAggregate(wrong_round, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "round 2" in err.value.details()
        _, own = sp.client_advertise(config.server.federation_id, protocol_round(1, int(header.attempt)), "dev-0",
                                     lambda m: b"")
        ok = s.SecureAggregate(pb.SecAggRequest(session_id=sessions[0], round=1, attempt=header.attempt,
                                                max_wait_s=0.0, advertisement=wire.advertisement_to_pb(own)),
                               timeout=10)
        assert ok.WhichOneof("kind") == "wait"
        with pytest.raises(grpc.RpcError) as err:  # the same advertisement again: a replay
            s.SecureAggregate(pb.SecAggRequest(session_id=sessions[0], round=1, attempt=header.attempt,
                                               advertisement=wire.advertisement_to_pb(own)), timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "already answered" in err.value.details()
        plain = pb.UpdateMessage(header=pb.UpdateHeader(session_id=sessions[0], round=1, kind=pb.WEIGHTS))
        with pytest.raises(grpc.RpcError) as err:  # a readable update is refused by a secure server
            s.PushUpdate(iter([plain]), timeout=10)
        assert "runs secure aggregation" in err.value.details()
    finally:
        ch.close()
        srv.stop()


def test_a_stopped_secure_federation_resumes_to_the_uninterrupted_model(tmp_path: Path) -> None:
    from tests.integration.helpers import stop_then_resume

    status, errors = _run(_config(tmp_path / "straight", True, rounds=4))
    assert status.outcome == "completed" and errors == [None] * K
    # Stopped once two rounds completed (the third in flight: its secure round is dropped and re-run).
    resumed = stop_then_resume(_config(tmp_path / "resumed", True, rounds=4), K)
    assert resumed is not None and resumed.outcome == "completed"
    assert [h.round for h in resumed.history] == [1, 2, 3, 4]
    a, b = _final(tmp_path / "straight"), _final(tmp_path / "resumed")
    assert all(a[k].numpy().tobytes() == b[k].numpy().tobytes() for k in a)


def test_signed_requests_sign_the_advertisements_and_use_the_unary_call(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under signed requests (no Session stream) the phases go over the unary ``SecureAggregate`` call, each
    advertisement signed by the device's enrolled key and verified by the server; a wrong signature is refused."""
    from fedguard.certs import enroll, generate_signing_key, write_private

    n = 3
    keys: dict[str, Path] = {}
    for i in range(n):
        private, public = generate_signing_key()
        keys[f"client-{i}"] = tmp_path / f"client-{i}.ed25519"
        write_private(keys[f"client-{i}"], private)
        enroll(tmp_path / "enrolled.json", f"client-{i}", public)
    config = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": n, "round_timeout_s": 30.0},
                           aggregation={"secure": "secagg+"}, secagg={"phase_timeout_s": 3.0},
                           security={"insecure": True, "client_keys": str(tmp_path / "enrolled.json")})
    calls: list[str] = []
    original = client_secure.SecureClient._next

    def counting(self: client_secure.SecureClient, r: Any, req: pb.SecAggRequest, want: str) -> Any:
        calls.append(req.WhichOneof("kind") or "")
        if req.WhichOneof("kind") == "advertisement":
            assert len(req.advertisement.signature) == 64  # Ed25519
        return original(self, r, req, want)

    monkeypatch.setattr(client_secure.SecureClient, "_next", counting)
    srv = ServerThread(config, linger_s=1.0).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=2.0, signing_key=str(keys[f"client-{i}"]))).start()
               for i in range(n)]
    status = srv.wait(120)
    for c in clients:
        c.join(30)
    assert status is not None and status.outcome == "completed"
    (round1,) = status.history
    assert round1.metrics["secagg_survivors"] == n and round1.attempt == 0
    assert sorted(set(calls)) == ["advertisement", "poll", "shares", "unmask"]

    # The server's verifier: the enrolled key's signature over this round's advertisement, nothing else.
    from fedcore.secagg import protocol as sp
    from fedcore.secagg.crypto import ed25519_signer, ed25519_verifier
    from fedguard.certs import load_enrollment, load_signing_key

    verify = ed25519_verifier(load_enrollment(str(tmp_path / "enrolled.json")))
    _, good = sp.client_advertise("f", 1, "client-0", ed25519_signer(load_signing_key(keys["client-0"])))
    _, forged = sp.client_advertise("f", 1, "client-0", ed25519_signer(load_signing_key(keys["client-1"])))
    assert verify("client-0", good.message(), good.signature)
    assert not verify("client-0", forged.message(), forged.signature)
