"""Secure aggregation's two ends (fedcore.secagg.aggregate): what a device masks and what the server makes of the sum
are, bit for bit, streaming FedAvg's -- weighted or not, with server-side DP's clip (on the device) and noise (on the
server, after unmasking) -- and w_div comes exactly from the sum of the squared norms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcore.aggregation import StreamingFedAvg
from fedcore.secagg import protocol as sp
from fedcore.secagg.aggregate import SecureFedAvg, prepare_input
from fedcore.secagg.config import SecureAggregationConfig, SecureSettings, protocol_round
from fedcore.secagg.crypto import KeyPair

FED = "fed"
P = 3000


def _accept(client_id: str, message: bytes, signature: bytes) -> bool:
    return True


def _secure_sum(inputs: dict[str, sp.Words], config: SecureAggregationConfig, num_extras: int) -> sp.SecureSum:
    """The protocol end to end over ``inputs`` (no dropouts), through the pure machines."""
    rnd = protocol_round(3, 1)
    ids = sorted(inputs)
    server, _ = sp.new_round(FED, rnd, ids, config, 7, P, num_extras)
    clients: dict[str, sp.ClientState] = {}
    for c in ids:
        clients[c], adv = sp.client_advertise(FED, rnd, c, lambda m: b"", (KeyPair.generate(), KeyPair.generate()))
        server, _ = sp.step(server, adv, _accept)
    for c in ids:
        clients[c], up = sp.client_share(clients[c], sp.key_request(server, c), _accept, config)
        server, _ = sp.step(server, up, _accept)
    for c in ids:
        clients[c], masked = sp.client_mask(clients[c], sp.mask_request(server, c), inputs[c])
        server, _ = sp.step(server, masked, _accept)
    events: list[sp.Event] = []
    for c in ids:
        clients[c], un = sp.client_unmask(clients[c], sp.unmask_request(server, c))
        server, events = sp.step(server, un, _accept)
    (done,) = [e for e in events if isinstance(e, sp.Completed)]
    return done.result


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize(("clip", "sigma"), [(None, 0.0), (0.5, 0.01)])
def test_secure_fedavg_is_bit_identical_to_streaming_fedavg(weighted: bool, clip: float | None,
                                                            sigma: float) -> None:
    rng = np.random.default_rng(5)
    ids = [f"c{i}" for i in range(6)]
    updates = {c: torch.from_numpy(rng.normal(0, 0.02 * (i + 1), P).astype(np.float32)) for i, c in enumerate(ids)}
    samples = {c: float(rng.integers(10, 500)) for c in ids}
    config = SecureAggregationConfig()
    settings = SecureSettings(config, clip_norm=clip, weighted=weighted)
    global_flat = torch.from_numpy(rng.normal(0, 1, P).astype(np.float32))

    plain = StreamingFedAvg(P, weighted, clip_norm=clip, noise_sigma=sigma)
    for c in reversed(ids):
        plain.add(updates[c], samples[c], key=c)
    want = plain.finalize(global_flat, torch.Generator().manual_seed(11))

    total = _secure_sum({c: prepare_input(updates[c], samples[c], settings) for c in ids}, config, 4)
    secure = SecureFedAvg(P, weighted, noise_sigma=sigma)
    secure.set_sum(total, samples)
    got = secure.finalize(global_flat, torch.Generator().manual_seed(11))

    assert got.new_global.numpy().tobytes() == want.new_global.numpy().tobytes()
    for key in ("num_updates", "num_clipped", "noise_norm", "max_weight_share", "rule_update_norm",
                "aggregate_update_norm"):
        assert got.metrics[key] == want.metrics[key], key
    if clip is not None:
        assert got.metrics["num_clipped"] >= 1  # the clip happened on the devices, counted in the sum
    # w_div: the weighted RMS of ||c_i - g|| (c_i the clipped update, g the applied step), from float64 sums.
    step = (got.new_global - global_flat).to(torch.float64)
    w = {c: samples[c] if weighted else 1.0 for c in ids}
    sq = 0.0
    for c in ids:
        u = updates[c].to(torch.float64)
        scale = 1.0 if clip is None else min(1.0, clip / float(torch.linalg.vector_norm(updates[c])))
        sq += w[c] * float(torch.sum((scale * u - step) ** 2))
    rms = math.sqrt(sq / sum(w.values()))
    # The step is the float32 mean (rounded once) plus float32 noise; the sums are exact: the two agree to a few
    # float32 roundings of the step's coordinates relative to the divergence.
    assert got.metrics["w_div"] == pytest.approx(rms, rel=1e-5)
    assert got.metrics["delta"] == pytest.approx(got.metrics["w_div"] - got.metrics["noise_norm"], abs=1e-12)


def test_a_device_that_masks_another_weight_than_it_reports_fails_the_round() -> None:
    config = SecureAggregationConfig()
    settings = SecureSettings(config)
    ids = ["a", "b", "c"]
    u = torch.full((P,), 1e-3)
    total = _secure_sum({c: prepare_input(u, 10.0, settings) for c in ids}, config, 4)
    agg = SecureFedAvg(P)
    agg.set_sum(total, {"a": 10.0, "b": 10.0, "c": 99.0})
    with pytest.raises(ValueError, match="masked another weight than it reported"):
        agg.finalize(torch.zeros(P))
    with pytest.raises(ValueError, match="no report from survivor 'c'"):
        SecureFedAvg(P).set_sum(total, {"a": 10.0, "b": 10.0})


def test_the_device_applies_the_bounds_the_server_cannot() -> None:
    u = torch.zeros(P)
    u[0] = 3.0
    bounded = SecureSettings(SecureAggregationConfig(norm_bound=2.0))
    with pytest.raises(ValueError, match="exceeds the secure-aggregation norm bound 2"):
        prepare_input(u, 1.0, bounded)
    # Clipped first (clip_norm below the bound), the same update is masked.
    words = prepare_input(u, 1.0, SecureSettings(SecureAggregationConfig(norm_bound=2.0), clip_norm=1.0))
    assert words.dtype == np.uint64 and words.shape == (2 * (P + 4),)
    with pytest.raises(ValueError, match="max_update_norm"):
        prepare_input(u, 1.0, SecureSettings(SecureAggregationConfig(), max_update_norm=1.0))
    u[1] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        prepare_input(u, 1.0, SecureSettings(SecureAggregationConfig()))
    with pytest.raises(ValueError, match="weight"):
        prepare_input(torch.zeros(P), 0.0, SecureSettings(SecureAggregationConfig()))


def test_in_place_sum_gives_the_same_result_and_only_then_touches_the_old_state() -> None:
    config = SecureAggregationConfig()
    rnd = protocol_round(1, 0)
    ids = ["a", "b", "c"]
    server, _ = sp.new_round(FED, rnd, ids, config, 7, P, 0)
    clients: dict[str, sp.ClientState] = {}
    for c in ids:
        clients[c], adv = sp.client_advertise(FED, rnd, c, lambda m: b"")
        server, _ = sp.step(server, adv, _accept)
    for c in ids:
        clients[c], up = sp.client_share(clients[c], sp.key_request(server, c), _accept, config)
        server, _ = sp.step(server, up, _accept)
    inputs = {c: sp.encode_input(np.full(P, 1e-3 * (i + 1), dtype=np.float32), 1.0) for i, c in enumerate(ids)}
    uploads = {}
    for c in ids:
        clients[c], uploads[c] = sp.client_mask(clients[c], sp.mask_request(server, c), inputs[c])
    pure = inplace = server
    for c in ids:
        before = None if pure.masked_sum is None else pure.masked_sum.copy()
        kept = pure
        pure, _ = sp.step(pure, uploads[c], _accept)
        if before is not None:
            assert kept.masked_sum is not None and np.array_equal(kept.masked_sum, before)  # untouched
        inplace, _ = sp.step(inplace, uploads[c], _accept, in_place=True)
    assert pure.masked_sum is not None and inplace.masked_sum is not None
    assert np.array_equal(pure.masked_sum, inplace.masked_sum)
