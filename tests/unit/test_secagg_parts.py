"""SecAgg+ building blocks: the neighbour graph and the choice of k and t, the config, the PRG, the crypto hooks,
and the fixed-point encoding the masked inputs are made of."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedcore.aggregation.fixedpoint import FixedPointSum, encode
from fedcore.errors import ConfigError
from fedcore.secagg import crypto, prg
from fedcore.secagg.config import SecureAggregationConfig
from fedcore.secagg.graph import choose_parameters, hypergeom_upper, neighbour_graph

ROOT = Path(__file__).resolve().parents[2]


def test_graph_is_k_regular_symmetric_and_seeded() -> None:
    ids = [f"d{i}" for i in range(30)]
    g = neighbour_graph(ids, 8, seed=3)
    assert set(g) == set(ids)
    for u, nb in g.items():
        assert len(nb) == 8 and u not in nb and list(nb) == sorted(nb)
        assert all(u in g[v] for v in nb)
    assert neighbour_graph(list(reversed(ids)), 8, seed=3) == g  # a function of the set of ids
    assert neighbour_graph(ids, 8, seed=4) != g
    assert neighbour_graph(ids, 29, seed=3)["d0"] == tuple(sorted(set(ids) - {"d0"}))  # complete
    with pytest.raises(ValueError, match="even"):
        neighbour_graph(ids, 7, seed=3)
    with pytest.raises(ValueError, match="distinct"):
        neighbour_graph(["a", "a", "b"], 2, seed=0)


def test_parameters_are_secure_and_reachable() -> None:
    cfg = SecureAggregationConfig()
    for n in (3, 4, 5, 9, 10, 21, 100, 1000):
        p = choose_parameters(n, cfg)
        assert 2 * p.threshold > p.neighbours  # the never-both rule protects: t shares of both need > k holders
        assert p.threshold >= 2 and p.max_dropped <= math.floor(n / 3)
        if p.complete:
            assert p.neighbours == n - 1 and p.threshold <= p.neighbours - p.max_dropped
        else:
            assert p.neighbours % 2 == 0 and p.neighbours < n - 1 and p.max_dropped == n // 3
    assert choose_parameters(3, cfg).max_dropped == 0  # t = 2 of 2 neighbours: no dropout can be tolerated
    p100 = choose_parameters(100, cfg)
    assert (p100.neighbours, p100.threshold) == (68, 35)
    assert choose_parameters(100, SecureAggregationConfig(max_dropout=0.1)).neighbours < 30
    assert choose_parameters(1000, cfg).neighbours < 300  # sparse: O(log K) neighbours, not K - 1
    fixed = choose_parameters(50, SecureAggregationConfig(neighbours=10, threshold=0.8))
    assert (fixed.neighbours, fixed.threshold, fixed.complete) == (10, 8, False)
    with pytest.raises(ValueError, match="at least 3"):
        choose_parameters(2, cfg)


def test_hypergeometric_tail() -> None:
    # 10 draws from 20 items with 5 marked: P[X > 4] = P[X = 5] = C(15,5) / C(20,10) ~ 0.0163
    assert hypergeom_upper(20, 5, 10, 0.02) == 4
    assert hypergeom_upper(20, 5, 10, 0.01) == 5
    assert hypergeom_upper(20, 0, 10, 1e-30) == 0


@pytest.mark.parametrize("field, kwargs", [
    ("neighbours", {"neighbours": 3}), ("neighbours", {"neighbours": -2}), ("threshold", {"threshold": 1.5}),
    ("max_dropout", {"max_dropout": 0.5}), ("corrupt_fraction", {"corrupt_fraction": 0.3}),
    ("security_bits", {"security_bits": 0}), ("correctness_bits", {"correctness_bits": 65}),
    ("min_clients", {"min_clients": 2}), ("norm_bound", {"norm_bound": float("nan")}),
])
def test_config_validation_names_the_field(field: str, kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError) as e:
        SecureAggregationConfig(**kwargs).validate()  # type: ignore[arg-type]
    assert e.value.field == field


def test_config_module_does_not_import_torch() -> None:
    code = ("import sys, fedcore.secagg, fedcore.secagg.config, fedcore.secagg.graph, fedcore.secagg.crypto, "
            "fedcore.secagg.prg, fedcore.secagg.shamir\nassert 'torch' not in sys.modules, 'torch imported'")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]


def test_prg_is_deterministic_and_masks_cancel() -> None:
    a, b = bytes(range(32)), bytes(range(1, 33))
    n = prg.CHUNK_WORDS * 2 + 17  # several chunks and a partial one
    x = prg.expand(a, n)
    assert x.dtype == np.uint64 and x.shape == (n,)
    assert np.array_equal(x, prg.expand(a, n)) and not np.array_equal(x, prg.expand(b, n))
    assert np.array_equal(prg.expand(a, 5), x[:5])  # a prefix of the same stream
    v = np.arange(n, dtype=np.uint64)
    prg.apply_masks(v, add=[a, b], subtract=[a])
    assert np.array_equal(v, np.arange(n, dtype=np.uint64) + prg.expand(b, n))
    prg.apply_masks(v, subtract=[b])
    assert np.array_equal(v, np.arange(n, dtype=np.uint64))
    with pytest.raises(ValueError, match="32 bytes"):
        prg.expand(b"short", 4)


def test_pairwise_seeds_agree_and_are_bound_to_the_round() -> None:
    u, v = crypto.KeyPair.generate(), crypto.KeyPair.generate()
    s_uv = crypto.mask_seed(u.private, v.public, "f", 3, "a", "b")
    assert s_uv == crypto.mask_seed(v.private, u.public, "f", 3, "b", "a")
    assert s_uv != crypto.mask_seed(u.private, v.public, "f", 4, "a", "b")
    assert s_uv != crypto.mask_seed(u.private, v.public, "g", 3, "a", "b")
    k = crypto.share_key(u.private, v.public, "f", 3, "a", "b")
    assert k != crypto.share_key(u.private, v.public, "f", 3, "b", "a")  # one key per direction
    blob = crypto.seal(k, b"secret share", crypto.share_aad("f", 3, "a", "b"))
    assert crypto.open_sealed(k, blob, crypto.share_aad("f", 3, "a", "b")) == b"secret share"
    with pytest.raises(crypto.DecryptionError):
        crypto.open_sealed(k, blob, crypto.share_aad("f", 4, "a", "b"))
    assert crypto.KeyPair.from_private_bytes(u.private_bytes()).public == u.public
    assert "private" not in repr(u)
    assert crypto.encode_parts("ab", "c") != crypto.encode_parts("a", "bc")
    assert crypto.encode_parts(1, 23) != crypto.encode_parts(12, 3)


def test_ed25519_hooks_bind_ids_to_identity_keys() -> None:
    key = Ed25519PrivateKey.generate()
    sign = crypto.ed25519_signer(key)
    verify = crypto.ed25519_verifier({"a": key.public_key()})
    msg = crypto.advertisement_message("f", 1, "a", bytes(32), bytes(range(32)))
    assert verify("a", msg, sign(msg))
    assert not verify("b", msg, sign(msg))  # unknown id
    assert not verify("a", crypto.advertisement_message("f", 2, "a", bytes(32), bytes(range(32))), sign(msg))


def test_encode_is_one_fixedpoint_add_and_add_encoded_sums_limbs() -> None:
    rng = np.random.default_rng(0)
    p = 70_000  # more than one FixedPointSum chunk
    us = [rng.normal(0, 1, p).astype(np.float32) for _ in range(3)]
    ms = [1.0, 37.0, 0.3]
    plain, limbs = FixedPointSum(p), FixedPointSum(p)
    for u, m in zip(us, ms, strict=True):
        plain.add(torch.from_numpy(u), m)
        one = FixedPointSum(p)
        one.add(torch.from_numpy(u), m)
        hi, lo = encode(u, m)
        assert np.array_equal(hi, one.hi.numpy().view(np.uint64)) and np.array_equal(lo, one.lo.numpy().view(np.uint64))
        assert np.array_equal(encode(torch.from_numpy(u), m)[0], hi)
        limbs.add_encoded(hi, lo)
    assert limbs.count == 3 and torch.equal(limbs.hi, plain.hi) and torch.equal(limbs.lo, plain.lo)
    assert torch.equal(limbs.value(38.3), plain.value(38.3))
    with pytest.raises(ValueError, match="uint64"):
        limbs.add_encoded(hi[:-1], lo)
    with pytest.raises(ValueError, match="float32 or float64"):
        encode(np.ones(3, np.int64), 1.0)  # type: ignore[arg-type]


def test_encode_into_given_arrays_equals_fresh_arrays() -> None:
    rng = np.random.default_rng(1)
    u = rng.normal(0, 1, 70_000).astype(np.float32)
    hi, lo = encode(u, 37.0)
    out = np.full(2 * u.size, 0xDEADBEEF, dtype=np.uint64)  # stale contents are overwritten, not added to
    got = encode(u, 37.0, out=(out[: u.size], out[u.size :]))
    assert np.array_equal(out[: u.size], hi) and np.array_equal(out[u.size :], lo)
    assert np.shares_memory(got[0], out) and np.shares_memory(got[1], out)
    with pytest.raises(ValueError, match="uint64"):
        encode(u, 1.0, out=(out[: u.size - 1], out[u.size :]))
