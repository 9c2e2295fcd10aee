"""Seed derivation and freedom from torch's global RNG: training is bit-identical whatever other threads do."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from fedcore.config import TrainingConfig
from fedcore.data import ClientData, load_client_data
from fedcore.metrics import train_private_model
from fedcore.models import build_model
from fedcore.seeds import (
    ATTACK,
    BATCHES,
    DROPOUT,
    GLOBAL_RNG_LOCK,
    PRIVATE,
    derive_seed,
    private_seed,
    round_seeds,
)
from fedcore.torch_rng import generator, seeded_global_rng
from fedcore.train import (
    NondeterministicModuleError,
    deterministic_dropout,
    generator_dropout,
    train_local,
)

State = dict[str, torch.Tensor]


# ---- derive_seed ----

def test_derive_seed_known_values() -> None:
    # Fixed forever: changing them changes every seeded run of every federation.
    assert derive_seed(0) == 2859687548095669751
    assert derive_seed(1, "a", 2, "batches") == 174787191077827575
    assert derive_seed(0, "client-3", 1, BATCHES) == derive_seed(0, "client-3", 1, "batches")


def test_derive_seed_is_a_63_bit_int_distinct_per_part() -> None:
    seeds = [
        derive_seed(),
        derive_seed(0),
        derive_seed("0"),
        derive_seed(1, 23),
        derive_seed(12, 3),
        derive_seed("1", 23),
        derive_seed(0, "client-1", 1, BATCHES),
        derive_seed(0, "client-1", 1, DROPOUT),
        derive_seed(0, "client-1", 2, BATCHES),
        derive_seed(0, "client-2", 1, BATCHES),
        derive_seed(1, "client-1", 1, BATCHES),
        derive_seed(0, "client-1", PRIVATE),
        derive_seed(-1),
        derive_seed(2**64 + 5),
        derive_seed(""),
        derive_seed("", ""),
    ]
    assert len(set(seeds)) == len(seeds)
    assert all(isinstance(s, int) and 0 <= s < 2**63 for s in seeds)
    rs = round_seeds(0, "client-1", 1)
    assert (rs.batches, rs.dropout) == (derive_seed(0, "client-1", 1, BATCHES), derive_seed(0, "client-1", 1, DROPOUT))
    assert len({rs.batches, rs.dropout, rs.attack, private_seed(0, "client-1")}) == 4
    assert torch.equal(torch.rand(5, generator=generator(4, "x")), torch.rand(5, generator=generator(4, "x")))
    with pytest.raises(TypeError):
        derive_seed(True)
    with pytest.raises(TypeError):
        derive_seed(1.5)  # type: ignore[arg-type]


def test_round_seeds_are_derive_seed_of_each_purpose() -> None:
    # round_seeds hashes (seed, client, round) once and finishes a copy per purpose: the same seeds, bit for bit.
    for seed, cid, r in [(0, "client-1", 1), (2**62, "", 0), (-7, "ü-client", 10**9), (5, "c" * 300, 3)]:
        rs = round_seeds(seed, cid, r)
        assert (rs.batches, rs.dropout, rs.attack) == (derive_seed(seed, cid, r, BATCHES),
                                                       derive_seed(seed, cid, r, DROPOUT),
                                                       derive_seed(seed, cid, r, ATTACK))


# ---- dropout from a generator ----

def test_generator_dropout_matches_torch_dropout_bit_for_bit() -> None:
    x = torch.randn(4, 5, 6, 7, generator=torch.Generator().manual_seed(0))
    cases: list[tuple[Callable[..., torch.Tensor], dict[str, bool]]] = [
        (F.dropout, {}), (F.alpha_dropout, {"alpha": True}), (F.dropout2d, {"feature": True}),
        (F.feature_alpha_dropout, {"feature": True, "alpha": True}),
    ]
    for p in (0.0, 0.3, 0.9, 1.0):
        for fn, kw in cases:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(5)
                want = fn(x, p, True)
            got = generator_dropout(x, p, torch.Generator().manual_seed(5), **kw)
            assert torch.equal(want, got), (fn.__name__, p)


def test_deterministic_dropout_modules_match_torch_and_restore_forward() -> None:
    shapes = {nn.Dropout: (3, 4, 5), nn.Dropout1d: (4, 5), nn.Dropout2d: (2, 3, 4, 5), nn.Dropout3d: (3, 2, 4, 5),
              nn.AlphaDropout: (3, 4), nn.FeatureAlphaDropout: (2, 3, 4)}
    for cls, shape in shapes.items():
        m = cls(0.4)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(9)
            want = m(x)
        state = torch.get_rng_state()
        with deterministic_dropout(m, 9):
            assert "forward" in m.__dict__
            got = m(x)
            m.eval()
            assert torch.equal(m(x), x)  # eval mode: the original forward, identity
            m.train()
        assert torch.equal(want, got), cls.__name__
        assert torch.equal(torch.get_rng_state(), state)
        assert "forward" not in m.__dict__  # the class's forward again

    net = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    with pytest.raises(RuntimeError, match="boom"), deterministic_dropout(net, 0):
        raise RuntimeError("boom")
    assert "forward" not in net[1].__dict__


def test_modules_that_would_use_the_global_rng_are_refused() -> None:
    x, y = torch.zeros(4, 3, 2), torch.zeros(4, dtype=torch.long)
    for bad in (nn.LSTM(2, 4, num_layers=2, dropout=0.2), nn.MultiheadAttention(4, 2, dropout=0.1), nn.RReLU()):
        with pytest.raises(NondeterministicModuleError), deterministic_dropout(nn.Sequential(bad), 0):
            pass

    class MyDropout(nn.Dropout):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return F.dropout(input, 0.5, self.training)

    with pytest.raises(NondeterministicModuleError, match="MyDropout"):
        train_local(nn.Sequential(nn.Flatten(), MyDropout(), nn.Linear(6, 2)), x, y, TrainingConfig())
    # One-layer LSTMs (the zoo's) and dropout-free attention are fine.
    with deterministic_dropout(nn.Sequential(nn.LSTM(2, 4, num_layers=2), nn.MultiheadAttention(4, 2)), 0):
        pass


# ---- training ----

class _Yield(nn.Module):
    """Gives the GIL away in every forward, so that concurrent training threads interleave step by step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.0002)
        return x


def _dropout_net(in_features: int = 60, num_classes: int = 10) -> nn.Module:
    return nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Dropout(0.5), _Yield(),
                         nn.Linear(32, 16), nn.ReLU(), nn.AlphaDropout(0.2), nn.Linear(16, num_classes))


_DATA = load_client_data("synthetic", 0, 0, {"min_samples": 80, "max_samples": 80})
_CFG = TrainingConfig(local_epochs=2, batch_size=10, learning_rate=0.05, momentum=0.5)


def _start_state() -> State:
    with seeded_global_rng(123):
        return {k: v.clone() for k, v in _dropout_net().state_dict().items()}


def _train(start: State, seed: int, data: ClientData = _DATA) -> State:
    model = _dropout_net()
    model.load_state_dict(start)
    train_local(model, data.x_train, data.y_train, _CFG, seed=seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class _Noise:
    """A thread that draws from torch's global RNG until stopped (someone else's unseeded code); ``locked``: each
    draw under GLOBAL_RNG_LOCK, as unseeded ``build_model`` calls do."""

    def __init__(self, locked: bool = False) -> None:
        self.locked = locked
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.locked:
                with GLOBAL_RNG_LOCK:
                    torch.rand(64)
            else:
                torch.rand(64)
            time.sleep(0.0001)

    def __enter__(self) -> _Noise:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def test_train_local_with_dropout_is_bit_identical_and_leaves_the_global_rng_alone() -> None:
    start = _start_state()
    model = _dropout_net()
    model.load_state_dict(start)
    state = torch.get_rng_state()
    train_local(model, _DATA.x_train, _DATA.y_train, _CFG, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drew from the global RNG
    a = _train(start, seed=7)
    assert _same(a, model.state_dict())
    assert _same(a, _train(start, seed=7))
    assert not _same(a, _train(start, seed=8))
    model = _dropout_net()
    model.load_state_dict(start)
    b_model = _dropout_net()
    b_model.load_state_dict(start)
    train_local(model, _DATA.x_train, _DATA.y_train, _CFG, seed=7, dropout_seed=1)
    train_local(b_model, _DATA.x_train, _DATA.y_train, _CFG, seed=7, dropout_seed=2)
    assert not _same(model.state_dict(), b_model.state_dict())  # the dropout seed is used
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_concurrent_train_local_equals_sequential() -> None:
    start = _start_state()
    seeds = [derive_seed(0, f"client-{i}", 1, BATCHES) for i in range(6)]
    sequential = [_train(start, s) for s in seeds]
    for _ in range(2):
        with _Noise(), ThreadPoolExecutor(6) as pool:
            concurrent = list(pool.map(lambda s: _train(start, s), seeds))
        assert all(_same(a, b) for a, b in zip(sequential, concurrent, strict=True))


def test_build_model_with_seed_is_deterministic_under_concurrency() -> None:
    want = build_model("mlp", {"hidden": [32, 16]}, seed=5).state_dict()
    state = torch.get_rng_state()

    def build(i: int) -> State:
        if i % 2:  # unseeded builds in between draw from the global RNG, under the lock
            build_model("mlp", {"hidden": [32, 16]})
            return {}
        return build_model("mlp", {"hidden": [32, 16]}, seed=5).state_dict()

    with ThreadPoolExecutor(6) as pool:
        got = [s for s in pool.map(build, range(24)) if s]
    assert len(got) == 12 and all(_same(want, s) for s in got)
    assert GLOBAL_RNG_LOCK.acquire(blocking=False)
    GLOBAL_RNG_LOCK.release()
    # The seeded builds restored the global RNG; only the unseeded ones advanced it.
    assert not torch.equal(torch.get_rng_state(), state)
    state = torch.get_rng_state()
    build_model("mlp", seed=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_concurrent_private_models_are_identical() -> None:
    data = [load_client_data("synthetic", i, 0, {"min_samples": 60, "max_samples": 60}) for i in range(6)]
    cfg = TrainingConfig(batch_size=10, learning_rate=0.05)

    def private(i: int) -> tuple[State, float]:
        return train_private_model(_dropout_net, data[i], cfg, epochs=2, seed=private_seed(0, f"client-{i}"))

    state = torch.get_rng_state()
    sequential = [private(i) for i in range(6)]
    assert torch.equal(torch.get_rng_state(), state)
    for _ in range(2):
        # Seeded initialisation draws from the global RNG under the lock: other draws must hold it too.
        with _Noise(locked=True), ThreadPoolExecutor(6) as pool:
            concurrent = list(pool.map(private, range(6)))
        for (sa, aa), (sb, ab) in zip(sequential, concurrent, strict=True):
            assert aa == ab and _same(sa, sb)
    # Distinct clients get distinct initialisations.
    assert not _same(sequential[0][0], sequential[1][0])
