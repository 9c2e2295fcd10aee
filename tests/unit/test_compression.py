"""Compressed updates (fedcore.compression): the codecs' error bounds from their arithmetic, error feedback, the
streaming decoder against one-shot decoding, refusals of malformed payloads, and the section's config errors."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedclient.state import RESIDUAL_FILE, ClientState, ClientStateError
from fedcore.compression.codecs import (
    FP16_MAX,
    CompressionError,
    Decoder,
    decode,
    encode,
    flat_update,
    layout,
    payload_bytes,
    roundtrip,
)
from fedcore.compression.config import CompressionConfig, topk_count
from fedcore.compression.device import DeviceCompressor
from fedcore.config import ConfigError, FederationInfo, ServerConfig, TrainingConfig, build_config
from fedcore.serialization import SerializationError
from fedguard import wire
from fedguard.v1 import fedguard_pb2 as pb

P = 10_000 + 37  # not a multiple of the int8 chunk: the last chunk is partial
KINDS = ("fp16", "int8", "topk")


def _update(seed: int = 0, p: int = P) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(p, generator=g) * 0.01
    x[100:4196] = 0.0  # a whole int8 chunk (4096..8191 overlaps) partly zero, and exact zeros
    x[5] = 3.0  # an outlier
    return x


def _payload(cfg: CompressionConfig, x: torch.Tensor) -> bytes:
    enc, _ = encode(x, None, cfg)
    return enc.payload.tobytes()


# ---- error bounds ----

def test_int8_error_is_at_most_half_a_scale_per_coordinate() -> None:
    cfg = CompressionConfig(kind="int8", int8_chunk=512)
    x = _update()
    enc, residual = encode(x, None, cfg)
    out = decode(cfg, P, [enc.payload.tobytes()])
    scales = torch.from_numpy(enc.parts[0].copy())
    assert enc.parts[0].shape == (math.ceil(P / 512),) and enc.parts[1].dtype == np.int8
    per_coord = scales.repeat_interleave(512)[:P]
    # round-to-nearest: |x - q s| <= s/2; x/s and q*s each add at most 127 s 2^-24 (float32).
    assert bool(((x - out).abs() <= per_coord * (0.5 + 2 * 127 * 2.0**-24)).all())
    assert bool((out[100:4196] == 0).all())  # zeros stay exactly zero
    assert float(scales.max()) == pytest.approx(3.0 / 127, rel=1e-7)
    assert residual is not None and torch.equal(residual, x - out)
    assert int(np.abs(enc.parts[1]).max()) == 127 and int(enc.parts[1].min()) >= -127


def test_fp16_error_is_half_float_rounding_and_the_range_is_clamped() -> None:
    cfg = CompressionConfig(kind="fp16")
    x = _update()
    x[7], x[8], x[9] = 1e-7, 70000.0, -1e9  # a subnormal half, and two beyond half's range
    out, residual = roundtrip(x, None, cfg)
    normal = x.abs() >= 2.0**-14
    inside = x.abs() <= FP16_MAX
    err = (x - out).abs()
    assert bool((err[normal & inside] <= x.abs()[normal & inside] * 2.0**-11).all())
    assert bool((err[~normal] <= 2.0**-25).all())
    assert float(out[8]) == FP16_MAX and float(out[9]) == -FP16_MAX  # clamped, never infinite
    assert residual is not None and float(residual[8]) == 70000.0 - FP16_MAX  # the excess carried with EF


def test_topk_sends_exactly_the_largest_coordinates() -> None:
    cfg = CompressionConfig(kind="topk", topk_fraction=0.01)
    x = _update()
    enc, residual = encode(x, None, cfg)
    k = math.ceil(0.01 * P)
    idx, vals = enc.parts
    assert idx.dtype == np.int32 and vals.dtype == np.float32 and len(idx) == k
    assert bool((np.diff(idx) > 0).all())
    out = decode(cfg, P, [enc.payload.tobytes()])
    kept = torch.from_numpy(idx.astype(np.int64))
    assert torch.equal(out[kept], x[kept])  # the kept coordinates exactly
    mask = torch.ones(P, dtype=torch.bool)
    mask[kept] = False
    assert bool((out[mask] == 0).all())
    assert float(x[mask].abs().max()) <= float(x[kept].abs().min())  # and they are the largest |x|
    assert residual is not None and bool((residual[kept] == 0).all()) and torch.equal(residual[mask], x[mask])


def test_topk_count_is_exact_on_the_fraction() -> None:
    assert topk_count(100, 0.07) == 7  # float: 0.07 * 100 = 7.000000000000001
    assert topk_count(940_362, 0.01) == 9404
    assert topk_count(10, 1e-9) == 1 and topk_count(10, 1.0) == 10 and topk_count(0, 0.5) == 0


def test_the_payload_sizes_follow_the_layout() -> None:
    p = 940_362  # cifar_cnn
    assert payload_bytes(CompressionConfig(kind="fp16"), p) == 2 * p
    assert payload_bytes(CompressionConfig(kind="int8"), p) == p + 4 * math.ceil(p / 4096)
    assert payload_bytes(CompressionConfig(kind="int8"), p) <= 0.26 * 4 * p
    assert payload_bytes(CompressionConfig(kind="topk"), p) == 8 * 9404
    with pytest.raises(CompressionError, match="no compressed payload"):
        layout(CompressionConfig(), p)


# ---- error feedback ----

@pytest.mark.parametrize("kind", KINDS)
def test_error_feedback_delivers_the_sum_of_the_updates(kind: str) -> None:
    cfg = CompressionConfig(kind=kind, int8_chunk=256, topk_fraction=0.02)
    residual: torch.Tensor | None = None
    sent = np.zeros(P)
    true = np.zeros(P)
    slack = np.zeros(P)  # the float32 roundings of x = u + r and r' = x - d: at most 2^-24 of each result
    for t in range(12):
        u = _update(seed=t)
        x = u if residual is None else u + residual
        enc, residual = encode(u, residual, cfg)
        assert residual is not None
        sent += decode(cfg, P, [enc.payload.tobytes()]).double().numpy()
        true += u.double().numpy()
        slack += (x.double().abs() + residual.double().abs()).numpy() * 2.0**-24
    assert residual is not None
    gap = np.abs(sent + residual.double().numpy() - true)
    assert bool((gap <= slack + 1e-12).all()), float((gap - slack).max())
    if kind == "topk":  # the residual is what was not sent: far from zero
        assert float(residual.abs().sum()) > 0


def test_without_error_feedback_nothing_is_kept() -> None:
    cfg = CompressionConfig(kind="int8", error_feedback=False)
    _, residual = encode(_update(), torch.ones(P), cfg)
    assert residual is None
    # ... and a residual given is not added
    a, _ = encode(_update(), torch.ones(P), cfg)
    b, _ = encode(_update(), None, cfg)
    assert a.payload.tobytes() == b.payload.tobytes()


class _Store:
    def __init__(self) -> None:
        self.saved: tuple[torch.Tensor, dict[str, object]] | None = None

    def load_residual(self) -> tuple[torch.Tensor, dict[str, object]] | None:
        return self.saved

    def save_residual(self, residual: torch.Tensor | None, meta: Mapping[str, object]) -> None:
        self.saved = None if residual is None else (residual.clone(), dict(meta))


def test_the_device_saves_and_restores_its_residual_and_resets_it_for_another_model() -> None:
    cfg = CompressionConfig(kind="int8")
    store = _Store()
    dev = DeviceCompressor(cfg, "fp-a", P, store)
    assert not dev.restored and dev.residual is None
    dev.encode(_update(1))
    assert store.saved is not None and dev.residual is not None
    assert torch.equal(store.saved[0], dev.residual)
    again = DeviceCompressor(cfg, "fp-a", P, store)  # a restart
    assert again.restored and again.residual is not None and torch.equal(again.residual, dev.residual)
    # the restarted device's next update is the one the first would have sent
    assert again.encode(_update(2)).payload.tobytes() == dev.encode(_update(2)).payload.tobytes()
    other_model = DeviceCompressor(cfg, "fp-b", P, store)
    assert not other_model.restored and other_model.residual is None and store.saved is None
    dev.encode(_update(3))
    other_kind = DeviceCompressor(CompressionConfig(kind="topk"), "fp-a", P, store)
    assert not other_kind.restored and other_kind.residual is None
    with pytest.raises(ValueError, match="coordinates for a model of"):
        other_kind.encode(torch.zeros(P + 1))


def test_the_client_state_keeps_the_residual_in_its_own_file(tmp_path: Path) -> None:
    state = ClientState.open(tmp_path)
    assert state.load_residual() is None
    r = torch.randn(50)
    state.save_residual(r, {"kind": "int8", "model_fingerprint": "x", "num_params": 50})
    loaded = ClientState.open(tmp_path).load_residual()
    assert loaded is not None and torch.equal(loaded[0], r) and loaded[1]["kind"] == "int8"
    state.save_residual(None, {})
    assert not (tmp_path / RESIDUAL_FILE).exists()
    (tmp_path / RESIDUAL_FILE).write_bytes(b"garbage")
    with pytest.raises(ClientStateError, match=r"unreadable compression residual.*delete it"):
        state.load_residual()
    assert ClientState.open(None).load_residual() is None


def test_flat_update_is_the_float_tensors_difference_in_order() -> None:
    received = {"a": torch.ones(2, 2), "n": torch.tensor(3), "b": torch.zeros(3)}
    trained = {"a": torch.full((2, 2), 1.5), "n": torch.tensor(4), "b": torch.tensor([1.0, 2.0, 3.0])}
    assert flat_update(received, trained).tolist() == [0.5] * 4 + [1.0, 2.0, 3.0]


# ---- streaming ----

@pytest.mark.parametrize("kind", KINDS)
def test_streaming_in_any_split_equals_one_shot_bit_for_bit(kind: str) -> None:
    cfg = CompressionConfig(kind=kind, int8_chunk=1000)
    raw = _payload(cfg, _update(4))
    whole = decode(cfg, P, [raw]).numpy().tobytes()
    rng = np.random.default_rng(7)
    for trial in range(6):
        dec = Decoder(cfg, P, len(raw))
        at = 0
        while at < len(raw):  # pieces of 1..9 bytes on the first trial (every element split), larger after
            n = int(rng.integers(1, 10 if trial == 0 else 5000))
            dec.feed(at, memoryview(raw)[at:at + n])
            at = min(len(raw), at + n)
        assert dec.finish().numpy().tobytes() == whole, trial
    out = torch.full((P,), 5.0)  # into a preallocated buffer (topk zeroes it first)
    dec = Decoder(cfg, P, out=out)
    dec.feed(0, raw)
    assert dec.finish() is out and out.numpy().tobytes() == whole


# ---- refusals ----

def _int8_raw(scales: np.ndarray[Any, Any], q: np.ndarray[Any, Any]) -> bytes:
    return scales.astype(np.float32).tobytes() + q.astype(np.int8).tobytes()


@pytest.mark.parametrize("bad_scale, reason", [(float("nan"), "scale 1 is nan"), (float("inf"), "scale 1 is inf"),
                                               (-0.5, "scale 1 is -0.5")])
def test_a_scale_must_be_finite_and_non_negative(bad_scale: float, reason: str) -> None:
    cfg = CompressionConfig(kind="int8", int8_chunk=4)
    raw = _int8_raw(np.array([0.1, bad_scale, 0.1]), np.zeros(10))
    with pytest.raises(CompressionError, match=reason):
        decode(cfg, 10, [raw])


def test_int8_minus_128_is_refused() -> None:
    cfg = CompressionConfig(kind="int8", int8_chunk=4)
    q = np.zeros(10)
    q[6] = -128
    with pytest.raises(CompressionError, match="coordinate 6 is -128"):
        decode(cfg, 10, [_int8_raw(np.full(3, 0.1), q)])


@pytest.mark.parametrize("indices, reason", [([0, 3, 3], "3 at position 2 repeats or is out of order"),
                                             ([4, 2, 9], "2 at position 1 repeats or is out of order"),
                                             ([0, 5, 10], r"index 10 is outside \[0, 10\)"),
                                             ([-1, 2, 3], r"index -1 is outside \[0, 10\)")])
def test_topk_indices_must_be_in_range_increasing_and_unique(indices: list[int], reason: str) -> None:
    cfg = CompressionConfig(kind="topk", topk_fraction=0.3)
    raw = np.array(indices, dtype=np.int32).tobytes() + np.ones(3, dtype=np.float32).tobytes()
    with pytest.raises(CompressionError, match=reason):
        decode(cfg, 10, [raw[:5], raw[5:]])  # split inside an index: the check spans chunks


def test_topk_order_is_checked_across_chunks() -> None:
    cfg = CompressionConfig(kind="topk", topk_fraction=0.3)
    dec = Decoder(cfg, 10)
    dec.feed(0, np.array([2, 7], dtype=np.int32).tobytes())
    with pytest.raises(CompressionError, match="7 at position 2 repeats"):
        dec.feed(8, np.array([7], dtype=np.int32).tobytes())


def test_byte_counts_and_order_are_checked() -> None:
    cfg = CompressionConfig(kind="fp16")
    with pytest.raises(CompressionError, match="is 20 bytes, 22 announced"):
        Decoder(cfg, 10, 22)
    dec = Decoder(cfg, 10, 20)
    with pytest.raises(CompressionError, match="chunk at offset 4, expected offset 0"):
        dec.feed(4, b"\0\0")
    with pytest.raises(CompressionError, match="more bytes than announced"):
        dec.feed(0, bytes(22))
    dec.feed(0, bytes(18))
    with pytest.raises(CompressionError, match="received 18 of 20"):
        dec.finish()
    assert issubclass(CompressionError, SerializationError)  # the receiver's refusal path takes it


def test_only_float32_vectors_are_encoded() -> None:
    with pytest.raises(CompressionError, match="float32 \\[P\\] vector"):
        encode(torch.zeros(3, dtype=torch.float64), None, CompressionConfig(kind="int8"))
    with pytest.raises(CompressionError, match="does not encode"):
        encode(torch.zeros(3), None, CompressionConfig())


# ---- configuration and the wire ----

def _server(**compression: Any) -> ServerConfig:
    overrides: list[tuple[list[str], Any]] = [(["security", "insecure"], True)]
    overrides += [(["compression", k], v) for k, v in compression.items()]
    return build_config(ServerConfig, None, overrides)


@pytest.mark.parametrize("values, field", [({"kind": "zip"}, "compression.kind"),
                                           ({"int8_chunk": 0}, "compression.int8_chunk"),
                                           ({"topk_fraction": 0.0}, "compression.topk_fraction"),
                                           ({"topk_fraction": 1.5}, "compression.topk_fraction"),
                                           ({"topk_fraction": float("nan")}, "compression.topk_fraction")])
def test_config_errors_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        _server(**values)
    assert e.value.field == field


def test_secure_aggregation_refuses_topk_and_takes_int8_and_fp16() -> None:
    def secure(kind: str) -> ServerConfig:
        return build_config(ServerConfig, None, [(["security", "insecure"], True), (["compression", "kind"], kind),
                                                 (["aggregation", "secure"], "secagg+"),
                                                 (["rounds", "clients_per_round"], 5)])
    with pytest.raises(ConfigError, match="top-k sends a few coordinates") as e:
        secure("topk")
    assert e.value.field == "compression.kind"
    assert secure("int8").compression.kind == "int8" and secure("fp16").compression.kind == "fp16"


def test_the_announcement_travels_and_none_is_not_sent() -> None:
    cfg = CompressionConfig(kind="topk", int8_chunk=1024, topk_fraction=0.05, error_feedback=False)
    assert wire.compression_from_pb(wire.compression_to_pb(cfg)) == cfg
    with pytest.raises(SerializationError, match="unknown compression kind 9"):
        wire.compression_from_pb(pb.CompressionSettings(kind=9))  # type: ignore[arg-type]
    with pytest.raises(SerializationError, match="int8_chunk"):
        wire.compression_from_pb(pb.CompressionSettings(kind=pb.COMPRESSION_INT8, topk_fraction=0.01))
    info = FederationInfo("f", "mlp", {}, "fp", (), TrainingConfig(), "synthetic", {}, 3, 0)
    assert not wire.federation_to_pb(info).HasField("compression")  # kind none: the announcement as before
    assert wire.federation_from_pb(wire.federation_to_pb(info)).compression == CompressionConfig()
    announced = dataclasses.replace(info, compression=cfg)
    assert wire.federation_from_pb(wire.federation_to_pb(announced)).compression == cfg
    assert _server().compression == CompressionConfig()
    assert _server(kind="int8").compression.keeps_residual and not CompressionConfig(kind="fp16",
                                                                                      error_feedback=False).keeps_residual


# ---- the measurement tool ----

def test_the_bench_campaign_runs_each_kind_with_its_override_and_summarizes(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import argparse
    import json

    from tools.bench import bench_compression as bc

    args = argparse.Namespace(seed=0, procs=1, rounds=150, private_epochs=0, topk_fraction=0.01)
    cmd = bc._command("topk", args, tmp_path / "topk-s0")
    assert "compression.kind='topk'" in cmd and "compression.topk_fraction=0.01" in cmd and bc.CONFIG in cmd
    assert bc._spec("int8", args)["kind"] == "int8" and "topk_fraction" not in bc._spec("int8", args)
    for kind, acc in (("none", 0.9), ("int8", 0.896)):
        (tmp_path / f"{kind}-s0").mkdir()
        per = 4 if kind == "none" else 1
        rows = [{"round": r, "accepted": 10, "central_accuracy": acc, "bytes_received": 10 * per} for r in range(1, 13)]
        (tmp_path / f"{kind}-s0" / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bc.summary(tmp_path) == 0
    out = capsys.readouterr().out
    assert "| int8-s0 | 12 | 0.8960 | 0.8960 | -0.40 | 0.8960 | 0.8960 | 1 |" in out
    assert "| none-s0 | 12 | 0.9000 | 0.9000 | +0.00 | 0.9000 | 0.9000 | 4 |" in out
