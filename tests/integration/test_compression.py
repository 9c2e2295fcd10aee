"""Compressed updates over gRPC on loopback: each kind's federation completes with the bytes its layout says, a
restarted device keeps its residual, the server refuses an update not encoded as announced or malformed (bounds on
the decoded update), and secure aggregation with int8 masks exactly what plain int8 delivers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from fedclient.state import RESIDUAL_FILE, ClientState
from fedcore.compression.codecs import layout, payload_bytes
from fedcore.compression.config import CompressionConfig
from fedcore.compression.device import DeviceCompressor
from fedcore.models import build_model
from fedcore.serialization import load_state, manifest_of, total_bytes
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb
from fedserver import ServerThread
from tests.integration.helpers import mark_ready, pull_model, run_federation, server_config, stub, update_messages

K = 4


def _config(tmp_path: Path, kind: str, rounds: int = 2, k: int = K, **sections: dict[str, Any]) -> Any:
    return server_config(tmp_path, rounds={"num_rounds": rounds, "clients_per_round": k, "round_timeout_s": 30.0},
                         training={"local_epochs": 1, "learning_rate": 0.05}, compression={"kind": kind},
                         **sections)


def _num_params() -> int:
    return sum(t.numel() for t in build_model("mlp", seed=0).state_dict().values() if t.is_floating_point())


@pytest.mark.parametrize("kind", ["none", "fp16", "int8", "topk"])
def test_each_kind_completes_and_the_rows_count_its_bytes(tmp_path: Path, kind: str) -> None:
    status, summaries = run_federation(_config(tmp_path, kind), K)
    assert status is not None and status.finished and status.outcome == "completed"
    assert all(s.finished and s.updates_accepted == 2 and s.updates_rejected == 0 for s in summaries)
    per_update = (total_bytes(manifest_of(build_model("mlp", seed=0).state_dict())) if kind == "none"
                  else payload_bytes(CompressionConfig(kind=kind), _num_params()))
    rows = [json.loads(line) for line in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["bytes_received"] for r in rows] == [K * per_update] * 2
    assert [h.bytes_received for h in status.history] == [K * per_update] * 2  # GetStatus carries it too
    fp32 = 4 * _num_params()
    ratio = {"none": (0.99, 1.01), "fp16": (0.49, 0.51), "int8": (0.24, 0.26), "topk": (0.0, 0.03)}[kind]
    assert ratio[0] <= per_update / fp32 <= ratio[1]
    assert all(np.isfinite(r["mean_train_loss"]) for r in rows)


def test_a_restarted_device_keeps_its_residual(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, torch.Tensor | None]] = []  # (restored, the residual each encoding starts from)
    encode = DeviceCompressor.encode

    def recording(self: DeviceCompressor, update: torch.Tensor) -> Any:
        seen.append((self.restored, None if self.residual is None else self.residual.clone()))
        return encode(self, update)

    monkeypatch.setattr(DeviceCompressor, "encode", recording)
    state_dir = tmp_path / "device"
    status, _ = run_federation(_config(tmp_path / "first", "int8", rounds=2, k=1), 1, state_dir=str(state_dir))
    assert status is not None and status.outcome == "completed"
    saved = ClientState.open(state_dir).load_residual()
    assert saved is not None and (state_dir / RESIDUAL_FILE).exists()
    residual, meta = saved
    assert meta["kind"] == "int8" and meta["num_params"] == _num_params() and float(residual.abs().sum()) > 0
    assert len(seen) == 2 and seen[0][1] is None and seen[1][1] is not None  # round 2 used round 1's residual
    # A new process of the device (a new FedClient on the same state dir) joins another federation of the model.
    status, _ = run_federation(_config(tmp_path / "second", "int8", rounds=1, k=1), 1, state_dir=str(state_dir))
    assert status is not None and status.outcome == "completed"
    restored, start = seen[2]
    assert restored and start is not None and torch.equal(start, residual)
    # Another kind does not use it: it starts from zero.
    status, _ = run_federation(_config(tmp_path / "third", "fp16", rounds=1, k=1), 1, state_dir=str(state_dir))
    assert status is not None and status.outcome == "completed"
    assert seen[3] == (False, None)


def _int8_update(session: str, num_params: int, scales: np.ndarray[Any, Any], q: np.ndarray[Any, Any],
                 compression: int = pb.COMPRESSION_INT8) -> list[pb.UpdateMessage]:
    cfg = CompressionConfig(kind="int8")
    data = scales.astype(np.float32).tobytes() + q.astype(np.int8).tobytes()
    header = pb.UpdateHeader(session_id=session, round=1, report=pb.UpdateReport(num_samples=10, train_loss=0.5),
                             kind=pb.DELTA, tensors=wire.metas_to_pb(layout(cfg, num_params)), total_bytes=len(data),
                             compression=compression)
    return [pb.UpdateMessage(header=header), pb.UpdateMessage(chunk=pb.Chunk(offset=0, data=data))]


def test_the_server_refuses_what_was_not_announced_and_bounds_the_decoded_update(tmp_path: Path) -> None:
    cases = ["weights", "fp16", "nan_scale", "overflow", "minus_128", "good"]
    cfg = server_config(tmp_path, rounds={"num_rounds": 1, "clients_per_round": len(cases), "min_updates": 1,
                                          "round_timeout_s": 60.0}, compression={"kind": "int8"})
    srv = ServerThread(cfg, linger_s=0.1).start()
    ch, s = stub(srv.address)
    try:
        joined = {c: s.Join(pb.JoinRequest(client_id=c), timeout=5) for c in cases}
        announced = wire.federation_from_pb(joined["good"].config).compression
        assert announced == CompressionConfig(kind="int8")  # what the devices follow
        sessions = {c: j.session_id for c, j in joined.items()}
        mark_ready(s, list(sessions.values()))
        p = _num_params()
        c = -(-p // 4096)
        assert c >= 2
        state: dict[str, torch.Tensor] | None = None
        for case in cases:
            header, state = pull_model(s, sessions[case])
            assert isinstance(header, pb.TaskHeader) and state is not None
        assert state is not None
        q = np.ones(p)
        scales = np.full(c, 1e-3)
        bad_q = q.copy()
        bad_q[12] = -128
        huge = np.full(c, 1e37)  # finite scales whose decoded values (127e37) are not float32
        uploads = {
            "weights": update_messages(sessions["weights"], 1, state),  # a plain update: not the announced kind
            "fp16": _int8_update(sessions["fp16"], p, scales, q, pb.COMPRESSION_FP16),
            "nan_scale": _int8_update(sessions["nan_scale"], p, np.where(np.arange(c) == c - 1, np.nan, scales), q),
            "overflow": _int8_update(sessions["overflow"], p, huge, q * 127),
            "minus_128": _int8_update(sessions["minus_128"], p, scales, bad_q),
        }
        expected = {
            "weights": (grpc.StatusCode.FAILED_PRECONDITION, "encoded as 'int8' (compression.kind, announced at "
                                                             "join), this one as 'none'"),
            "fp16": (grpc.StatusCode.FAILED_PRECONDITION, "this one as 'fp16'"),
            "nan_scale": (grpc.StatusCode.INVALID_ARGUMENT, f"int8 scale {c - 1} is nan"),
            "overflow": (grpc.StatusCode.INVALID_ARGUMENT, "decoded int8 update has non-finite values"),
            "minus_128": (grpc.StatusCode.INVALID_ARGUMENT, "int8 coordinate 12 is -128"),
        }
        for case, messages in uploads.items():
            with pytest.raises(grpc.RpcError) as e:
                s.PushUpdate(iter(messages), timeout=10)
            code, text = expected[case]
            assert e.value.code() == code and text in (e.value.details() or ""), (case, e.value.details())
        assert s.PushUpdate(iter(_int8_update(sessions["good"], p, scales, q)), timeout=10).accepted
        deadline = time.monotonic() + 10
        while not srv.coordinator.history and time.monotonic() < deadline:  # type: ignore[union-attr]
            time.sleep(0.02)
        row = srv.coordinator.history[0]  # type: ignore[union-attr]
        assert row.accepted == 1 and row.rejected == len(uploads) and row.bytes_received == 4 * c + p
    finally:
        ch.close()
        srv.stop()


def test_secure_aggregation_with_int8_masks_what_plain_int8_delivers(tmp_path: Path) -> None:
    def run(name: str, secure: str) -> dict[str, torch.Tensor]:
        cfg = _config(tmp_path / name, "int8", rounds=2, aggregation={"secure": secure},
                      secagg={"phase_timeout_s": 3.0})
        status, summaries = run_federation(cfg, K)
        assert status is not None and status.outcome == "completed", name
        assert all(s.updates_accepted == 2 for s in summaries)
        if secure != "off":  # the server summed masked inputs (8 B per word, two words per coordinate)
            assert all(h.metrics["secagg_survivors"] == K for h in status.history)
            assert all(h.bytes_received > K * 16 * _num_params() for h in status.history)
        state, _ = load_state(tmp_path / name / "run" / "final_model.fgt")
        return state

    plain, secure = run("plain", "off"), run("secure", "secagg+")
    for name in plain:
        assert plain[name].numpy().tobytes() == secure[name].numpy().tobytes(), name
