"""DistFL's functional core (fedcore.distfl): extraction, KL similarity, threshold components, ARI, clusters."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from fedcore.config import ConfigError, from_dict
from fedcore.distfl import (
    ClusterAssigned,
    ClusterEvent,
    ClusterFormed,
    ClusterInfo,
    ClusterObservation,
    ClusterState,
    DistflConfig,
    adjusted_rand_index,
    bn_layers,
    bn_statistics_loss,
    check_has_batchnorm,
    cluster_members,
    cluster_of,
    clustering_due,
    extract_inputs,
    flatten_response,
    kl_matrix,
    link_components,
    responses,
    select_channels,
    step,
    synthesize,
)
from fedcore.torch_rng import generator

# ---- helpers ----


def _bn_cnn(seed: int = 0) -> nn.Sequential:
    """A tiny 2-D CNN with two BN layers whose weights and running statistics are far from the defaults."""
    g = torch.Generator().manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                      nn.Conv2d(4, 6, 3, padding=1, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for bn in (m[1], m[4]):
            assert isinstance(bn, nn.BatchNorm2d)
            assert bn.running_mean is not None and bn.running_var is not None
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g) * 3 + 0.5)
    return m


def _state_of(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


CFG_FAST = DistflConfig(z=16, steps=60, lr=0.1, top_fraction=0.5, jitter=1)


def _kl_rows(p: Sequence[Sequence[float]], q: Sequence[Sequence[float]]) -> float:
    """Mean over rows of the per-row KL divergence, by hand."""
    return sum(sum(a * math.log(a / b) for a, b in zip(pr, qr, strict=True) if a > 0)
               for pr, qr in zip(p, q, strict=True)) / len(p)


# ---- configuration ----

def test_config_defaults_validate_and_load_from_a_table() -> None:
    c = DistflConfig().validate()
    assert (c.enabled, c.z, c.top_fraction, c.tau, c.warmup_rounds, c.jitter) == (False, 200, 0.5, 0.2, 5, 2)
    c = from_dict(DistflConfig, {"enabled": True, "z": 100, "tau": 0.3, "recluster_every": 0}, "distfl").validate()
    assert c.enabled and c.z == 100 and c.tau == 0.3 and c.recluster_every == 0


@pytest.mark.parametrize(("field", "value"), [
    ("z", 0), ("z", True), ("steps", -1), ("lr", 0.0), ("lr", math.inf), ("top_fraction", 0.0),
    ("top_fraction", 1.5), ("tau", 0), ("tau", -0.1), ("tau", math.nan), ("warmup_rounds", -1),
    ("recluster_every", -1), ("jitter", -2), ("jitter", 1.5), ("enabled", 1),
])
def test_config_validation_names_the_field(field: str, value: object) -> None:
    c = DistflConfig()
    setattr(c, field, value)
    with pytest.raises(ConfigError, match=rf"^distfl\.{field}: ") as e:
        c.validate()
    assert e.value.field == f"distfl.{field}"
    with pytest.raises(ConfigError, match=rf"^server\.distfl\.{field}: "):
        c.validate("server.distfl")


# ---- extraction (§4.2) ----

def test_a_model_without_batchnorm_is_refused_with_the_reason() -> None:
    plain = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="BatchNorm") as e:
        check_has_batchnorm(plain, "mlp")
    assert "'mlp'" in str(e.value) and "running" in str(e.value)
    with pytest.raises(ValueError, match="BatchNorm"):
        synthesize(plain, (4,), CFG_FAST, torch.Generator().manual_seed(0))
    untracked = nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 2))
    assert bn_layers(untracked) == []
    with pytest.raises(ValueError, match="BatchNorm"):
        check_has_batchnorm(untracked, "untracked")
    check_has_batchnorm(_bn_cnn(), "bn_cnn")
    assert len(bn_layers(_bn_cnn())) == 2


def test_select_channels_takes_the_top_fraction_by_absolute_gamma() -> None:
    bn = nn.BatchNorm1d(4)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.1, -3.0, 2.0, 0.5]))
    assert select_channels(bn, 0.5).tolist() == [1, 2]
    assert select_channels(bn, 0.6).tolist() == [1, 2, 3]  # ceil(2.4) = 3
    assert select_channels(bn, 0.01).tolist() == [1]  # at least one
    assert select_channels(bn, 1.0).tolist() == [0, 1, 2, 3]
    with torch.no_grad():
        bn.weight.fill_(1.0)
    assert select_channels(bn, 0.5).tolist() == [0, 1]  # ties: lower index
    assert select_channels(nn.BatchNorm1d(3, affine=False), 0.34).tolist() == [0, 1, 2]


def test_extraction_loss_falls_and_the_gradient_moves_the_inputs() -> None:
    m = _bn_cnn()
    before = _state_of(m)
    m.train()
    next(m.parameters()).requires_grad_(False)  # a mixed pattern, to check it comes back exactly
    flags = [p.requires_grad for p in m.parameters()]
    ex = synthesize(m, (1, 8, 8), CFG_FAST, torch.Generator().manual_seed(1))
    noise = torch.randn((16, 1, 8, 8), generator=torch.Generator().manual_seed(1))

    assert ex.inputs.shape == (16, 1, 8, 8) and not ex.inputs.requires_grad
    assert len(ex.losses) == CFG_FAST.steps
    assert ex.losses[-1] < 0.7 * ex.losses[0] and ex.final_loss < 0.7 * ex.losses[0]
    assert (ex.inputs - noise).abs().max() > 0.1  # the optimiser moved the inputs (the gradient reached them)
    assert ex.final_loss == pytest.approx(bn_statistics_loss(m, ex.inputs, CFG_FAST.top_fraction))
    assert bn_statistics_loss(m, noise, CFG_FAST.top_fraction) > ex.final_loss
    # The model is untouched: parameters and running statistics, requires_grad flags, train mode, no grads.
    after = _state_of(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.requires_grad for p in m.parameters()] == flags and m.training
    assert all(p.grad is None for p in m.parameters())


def test_extraction_matches_only_the_selected_channels_of_a_bn_on_the_input() -> None:
    # A BN directly on the input: its running statistics are the input distribution itself, and only the channel
    # with the larger |gamma| is matched at top_fraction 0.5 (Eq. 4's S).
    bn = nn.BatchNorm2d(2)
    m = nn.Sequential(bn, nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    assert bn.running_mean is not None and bn.running_var is not None
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([1.5, -2.0]))
        bn.running_var.copy_(torch.tensor([0.25, 4.0]))
        bn.weight.copy_(torch.tensor([0.1, -3.0]))
    cfg = DistflConfig(z=16, steps=150, lr=0.1, top_fraction=0.5, jitter=0)
    x = extract_inputs(m, (2, 4, 4), cfg, torch.Generator().manual_seed(3))
    mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), correction=0)
    assert mean[1].item() == pytest.approx(-2.0, abs=0.1) and var[1].item() == pytest.approx(4.0, rel=0.05)
    assert abs(mean[0].item()) < 0.5 and var[0].item() > 0.5  # channel 0 left near N(0, 1)
    x = extract_inputs(m, (2, 4, 4), DistflConfig(z=16, steps=150, top_fraction=1.0, jitter=0),
                       torch.Generator().manual_seed(3))
    mean = x.mean((0, 2, 3))
    assert mean[0].item() == pytest.approx(1.5, abs=0.1)


def test_extraction_is_deterministic_given_the_generator_seed() -> None:
    m = _bn_cnn()
    a = synthesize(m, (1, 8, 8), CFG_FAST, generator(7, "distfl", 3))
    b = synthesize(m, (1, 8, 8), CFG_FAST, generator(7, "distfl", 3))
    c = synthesize(m, (1, 8, 8), CFG_FAST, generator(7, "distfl", 4))
    assert torch.equal(a.inputs, b.inputs) and a.losses == b.losses
    assert not torch.equal(a.inputs, c.inputs)
    torch.manual_seed(0)
    g_state = torch.random.get_rng_state()
    synthesize(m, (1, 8, 8), CFG_FAST, generator(7, "distfl", 3))
    assert torch.equal(torch.random.get_rng_state(), g_state)  # torch's global RNG is never drawn from


def test_extraction_on_1d_signals_and_flat_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    har = nn.Sequential(nn.BatchNorm1d(3), nn.Conv1d(3, 4, 3, padding=1, bias=False), nn.BatchNorm1d(4),
                        nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 2))
    flat = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 2))
    for m in (har, flat):
        with torch.no_grad():
            for bn in bn_layers(m):
                assert bn.running_mean is not None and bn.running_var is not None
                bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
                bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
    cfg = DistflConfig(z=8, steps=40, jitter=2)
    a = synthesize(har, (3, 12), cfg, torch.Generator().manual_seed(5))  # jitter rolls the last dim
    b = synthesize(har, (3, 12), cfg, torch.Generator().manual_seed(5))
    assert a.inputs.shape == (8, 3, 12) and torch.equal(a.inputs, b.inputs)
    assert a.final_loss < a.losses[0]
    f = synthesize(flat, (5,), cfg, torch.Generator().manual_seed(5))  # no spatial dims: no jitter
    assert f.inputs.shape == (8, 5) and f.final_loss < f.losses[0]
    noise = synthesize(flat, (5,), DistflConfig(z=8, steps=0), torch.Generator().manual_seed(5))
    assert noise.losses == [] and torch.equal(noise.inputs, torch.randn((8, 5), generator=torch.Generator()
                                                                         .manual_seed(5)))


def test_extraction_runs_on_the_zoo_models_with_batchnorm() -> None:
    from fedcore.models import build_model

    with pytest.raises(ValueError, match="BatchNorm"):
        check_has_batchnorm(build_model("mnist_cnn", seed=0), "mnist_cnn")
    cfg = DistflConfig(z=4, steps=2)
    for name, kwargs in (("mnist_cnn_bn", {}), ("har_cnn", {"window": 32})):
        m = build_model(name, kwargs, seed=0)
        check_has_batchnorm(m, name)
        shape = tuple(m.input_shape)  # type: ignore[arg-type]
        ex = synthesize(m, shape, cfg, generator(0, name))
        assert ex.inputs.shape == (4, *shape) and len(ex.losses) == 2
        assert responses(m, ex.inputs).shape == (4, 10 if name == "mnist_cnn_bn" else 6)


# ---- responses and the KL matrix (§4.3, Eq. 5-6) ----

def test_responses_are_softmax_rows_in_eval_mode() -> None:
    m = _bn_cnn()
    m.train()
    x = torch.randn((5, 1, 8, 8), generator=torch.Generator().manual_seed(0))
    before = _state_of(m)
    v = responses(m, x)
    assert v.shape == (5, 3) and v.dtype == torch.float64
    assert torch.allclose(v.sum(1), torch.ones(5, dtype=torch.float64))
    assert m.training and all(torch.equal(before[k], t) for k, t in _state_of(m).items())  # BN stats not updated
    m.eval()
    with torch.no_grad():
        assert torch.allclose(v, torch.softmax(m(x).double(), 1))
    flat, shape = flatten_response(v)
    assert shape == (5, 3) and len(flat) == 15 and all(isinstance(a, float) for a in flat)


def test_kl_matrix_against_a_hand_computation() -> None:
    v1 = [[0.5, 0.5], [0.9, 0.1]]
    v2 = [[0.25, 0.75], [0.5, 0.5]]
    v3 = [[0.8, 0.2], [0.3, 0.7]]
    f64 = torch.float64
    p = kl_matrix([torch.tensor(v1, dtype=f64), torch.tensor(v2, dtype=f64), [a for r in v3 for a in r]])
    assert p.shape == (3, 3) and p.dtype == torch.float64
    # Tolerance from the arithmetic: each entry sums 4 float64 terms of magnitude < 1, each carrying a rounding error
    # of a few ulps, so |error| < 4 * 4 * 2^-53 ~ 2e-15 whatever the summation order (CPU, vector width).
    for i, vi in enumerate((v1, v2, v3)):
        for j, vj in enumerate((v1, v2, v3)):
            assert p[i, j].item() == pytest.approx(_kl_rows(vi, vj), rel=0, abs=2e-15)
    assert p[0, 1].item() == pytest.approx(0.5 * (0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)
                                                  + 0.9 * math.log(1.8) + 0.1 * math.log(0.2)))
    assert p[0, 1].item() != pytest.approx(p[1, 0].item())  # not symmetric
    assert torch.equal(p.diagonal(), torch.zeros(3, dtype=torch.float64))  # set, not computed
    # Exact by construction on any CPU: each term is P_i (log P_i - log P_j) with log P_i - log P_j = 0 exactly.
    assert kl_matrix([torch.tensor(v1), torch.tensor(v1)]).abs().max().item() == 0.0
    # A zero in q is clamped: large but finite.
    z = kl_matrix([[0.5, 0.5], [1.0, 0.0]])
    assert math.isfinite(z[0, 1].item()) and z[0, 1].item() > 10 and z[1, 0].item() == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="values"):
        kl_matrix([[0.5, 0.5], [1.0, 0.0, 0.0]])
    assert kl_matrix([]).shape == (0, 0)


def test_identical_responses_have_a_kl_of_exactly_zero_whatever_their_length() -> None:
    """Two clients with the same responses are at KL 0 exactly, not at 2e-16 on one CPU and 0 on another (a sum
    of P log P minus a BLAS matmul adds in CPU-dependent orders); different responses stay strictly positive."""
    g = torch.Generator().manual_seed(5)
    r = torch.rand(64, 10, generator=g, dtype=torch.float64).softmax(dim=1)
    other = torch.rand(64, 10, generator=g, dtype=torch.float64).softmax(dim=1)
    p = kl_matrix([r, r.clone(), other, r.flatten().tolist()])
    for i, j in ((0, 1), (1, 0), (0, 3), (3, 1)):
        assert p[i, j].item() == 0.0
    assert p[0, 2].item() > 0 and p[2, 0].item() > 0


# ---- threshold components (union-find) ----

def test_link_components_with_one_way_links_and_a_chain() -> None:
    big = 9.0
    p = [
        # A    B    C    D    E
        [0.0, 0.1, big, big, big],  # A-B linked both ways
        [0.1, 0.0, 0.1, big, big],  # B->C only: enough
        [big, 0.9, 0.0, big, big],
        [big, big, big, 0.0, 0.5],
        [big, big, big, 0.15, 0.0],  # E->D only
    ]
    assert link_components(p, 0.2) == [[0, 1, 2], [3, 4]]  # A-C not linked, but the chain A-B-C is one component
    assert link_components(torch.tensor(p), 0.2) == [[0, 1, 2], [3, 4]]
    assert link_components(p, 0.1) == [[0], [1], [2], [3], [4]]  # strict: p == tau is no link
    assert link_components(p, 0.6) == [[0, 1, 2], [3, 4]]
    assert link_components(p, 100.0) == [[0, 1, 2, 3, 4]]
    q = [[0.0, 5.0, 5.0, 0.1], [5.0, 0.0, 0.1, 5.0], [5.0, 5.0, 0.0, 5.0], [5.0, 5.0, 5.0, 0.0]]
    assert link_components(q, 1.0) == [[0, 3], [1, 2]]  # sorted by smallest member
    assert link_components([], 1.0) == []
    with pytest.raises(ValueError, match="square"):
        link_components([[0.0, 1.0]], 1.0)


# ---- adjusted Rand index ----

def test_adjusted_rand_index_on_hand_examples() -> None:
    a = [0, 0, 0, 1, 1, 2]
    assert adjusted_rand_index(a, a) == 1.0
    assert adjusted_rand_index(a, ["x", "x", "x", "y", "y", "z"]) == 1.0  # label names do not matter
    assert adjusted_rand_index(a, [5, 5, 5, 3, 3, 1]) == 1.0
    # Contingency {(0,0):2, (1,1):1, (2,1):1}: Σ C(n_ij,2) = 1, Σ C(a,2) = 1, Σ C(b,2) = 2, C(4,2) = 6:
    # (1 − 1·2/6) / (1.5 − 1/3) = 4/7 (also scikit-learn's documented value, 0.57).
    assert adjusted_rand_index([0, 0, 1, 2], [0, 0, 1, 1]) == pytest.approx(4 / 7)
    assert adjusted_rand_index([0, 0, 1, 1], [0, 0, 1, 2]) == pytest.approx(4 / 7)
    assert adjusted_rand_index([0, 0, 0, 0], [0, 1, 2, 3]) == 0.0
    assert adjusted_rand_index([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(-0.5)
    assert adjusted_rand_index([1, 1, 1], [2, 2, 2]) == 1.0  # trivial identical partitions
    assert adjusted_rand_index([], []) == 1.0
    with pytest.raises(ValueError):
        adjusted_rand_index([0, 1], [0])


# ---- the cluster state machine (SPEC §8, cross-device) ----

SHAPE = (2, 3)
_TYPE_ROWS = {"A": (0.9, 0.05, 0.05), "B": (0.05, 0.9, 0.05), "C": (0.05, 0.05, 0.9)}


def _resp(kind: str, wobble: float = 0.0) -> list[float]:
    """A [2, 3] response of distribution type ``kind``, nudged by ``wobble`` (small: same cluster)."""
    a, b, c = _TYPE_ROWS[kind]
    row = [a - wobble, b + wobble, c]
    return [*row, *row]


def _obs(round_: int, probe: str, **kinds: tuple[str, float]) -> ClusterObservation:
    return ClusterObservation(round_, {cid: _resp(k, w) for cid, (k, w) in kinds.items()}, SHAPE, probe)


def _trip(s: ClusterState) -> ClusterState:
    return ClusterState.from_dict(json.loads(json.dumps(s.to_dict(), allow_nan=False)))


def _formed(events: Sequence[ClusterEvent]) -> ClusterFormed:
    assert len(events) == 1 and isinstance(events[0], ClusterFormed)
    return events[0]


def test_cluster_machine_warm_up_clustering_newcomer_reclustering_round_trip_and_replay() -> None:
    cfg = DistflConfig(warmup_rounds=2, recluster_every=3, tau=0.2, threshold="fixed")
    s = ClusterState()
    # Warm-up: responses stored, no clusters (everyone on the global model).
    s, ev = step(s, _obs(1, "w", a1=("A", 0.0), b1=("B", 0.0)), cfg)
    assert ev == [] and s.assignment == {} and cluster_of(s, "a1") is None and set(s.responses) == {"a1", "b1"}
    s, ev = step(s, ClusterObservation(2, {}, SHAPE), cfg)
    assert ev == [] and s.clustered_round == 0
    assert clustering_due(s, 3, cfg) and not clustering_due(s, 2, cfg)

    # First clustering after warm-up, on a fresh probe: two clusters, seeded from the global model.
    s, ev = step(s, _obs(3, "p3", a1=("A", 0.0), a2=("A", 0.01), b1=("B", 0.0), b2=("B", 0.02)), cfg)
    f = _formed(ev)
    assert f == ClusterFormed(3, (ClusterInfo("c0", ("a1", "a2"), None), ClusterInfo("c1", ("b1", "b2"), None)),
                              tau=0.2)
    assert f.sizes == {"c0": 2, "c1": 2}
    assert s.clustered_round == 3 and cluster_of(s, "b2") == "c1"

    # Between re-clusterings: newcomers join the cluster of their nearest response (same probe).
    assert not clustering_due(s, 4, cfg)
    s, ev = step(s, _obs(4, "p3", a3=("A", 0.002), x1=("C", 0.0), b1=("B", 0.01)), cfg)
    assert [type(e) for e in ev] == [ClusterAssigned, ClusterAssigned]
    e_a3, e_x1 = ev
    assert isinstance(e_a3, ClusterAssigned) and isinstance(e_x1, ClusterAssigned)
    assert (e_a3.round, e_a3.client_id, e_a3.cluster_id, e_a3.nearest) == (4, "a3", "c0", "a1")
    p = kl_matrix([_resp("A", 0.002), _resp("A", 0.0)])
    assert e_a3.distance == pytest.approx(min(p[0, 1].item(), p[1, 0].item())) and e_a3.distance < cfg.tau
    assert e_x1.client_id == "x1" and e_x1.distance > cfg.tau  # nearest cluster even when far (SPEC §8)
    assert cluster_of(s, "a3") == "c0" and cluster_of(s, "b1") == "c1"  # b1 keeps its cluster

    # Round trip mid-run: the restored machine continues identically.
    r = _trip(s)
    assert r == s and r.to_dict() == s.to_dict()
    s, ev = step(s, ClusterObservation(5, {}, SHAPE, "p3"), cfg)
    r, ev_r = step(r, ClusterObservation(5, {}, SHAPE, "p3"), cfg)
    assert ev == ev_r == []

    # Re-clustering at 3 + 3: ids stay stable; the far-away x1 gets its own cluster, seeded from the one it was in.
    assert clustering_due(s, 6, cfg)
    obs6 = _obs(6, "p6", a1=("A", 0.0), a2=("A", 0.01), a3=("A", 0.0), b1=("B", 0.0), b2=("B", 0.0),
                x1=("C", 0.0))
    s, ev = step(s, obs6, cfg)
    r, ev_r = step(r, obs6, cfg)
    assert ev == ev_r and r == s
    f = _formed(ev)
    assert f.clusters == (ClusterInfo("c0", ("a1", "a2", "a3"), "c0"), ClusterInfo("c1", ("b1", "b2"), "c1"),
                          ClusterInfo("c2", ("x1",), e_x1.cluster_id))
    assert f.retired == () and f.excluded == () and s.next_id == 3

    # A replayed round changes nothing.
    snapshot = s.to_dict()
    for replay in (obs6, _obs(4, "p3", z9=("B", 0.0)), ClusterObservation(6, {}, SHAPE)):
        s, ev = step(s, replay, cfg)
        assert ev == [] and s.to_dict() == snapshot
    assert not clustering_due(s, 6, cfg) and not clustering_due(s, 8, cfg) and clustering_due(s, 9, cfg)


def test_reclustering_id_mapping_split_merge_and_ties() -> None:
    cfg = DistflConfig(warmup_rounds=0, recluster_every=1, tau=0.2, threshold="fixed")
    s, ev = step(ClusterState(), _obs(1, "p1", a=("A", 0), b=("A", 0), c=("A", 0), d=("A", 0)), cfg)
    assert _formed(ev).clusters == (ClusterInfo("c0", ("a", "b", "c", "d"), None),)
    # Split: the larger part keeps c0, the other gets a fresh id seeded from c0.
    s, ev = step(s, _obs(2, "p2", a=("A", 0), b=("A", 0), c=("A", 0), d=("B", 0)), cfg)
    f = _formed(ev)
    assert f.clusters == (ClusterInfo("c0", ("a", "b", "c"), "c0"), ClusterInfo("c1", ("d",), "c0"))
    assert f.retired == ()
    # Merge: the union takes the id of the larger contributor (c0), c1 is retired.
    s, ev = step(s, _obs(3, "p3", a=("A", 0), b=("A", 0), c=("A", 0), d=("A", 0)), cfg)
    f = _formed(ev)
    assert f.clusters == (ClusterInfo("c0", ("a", "b", "c", "d"), "c0"),) and f.retired == ("c1",)
    # Tie (2 from c0 ... after a 2-2 split, then a merge): the smaller id wins.
    s, ev = step(s, _obs(4, "p4", a=("A", 0), b=("A", 0), c=("B", 0), d=("B", 0)), cfg)
    assert _formed(ev).clusters == (ClusterInfo("c0", ("a", "b"), "c0"), ClusterInfo("c2", ("c", "d"), "c0"))
    s, ev = step(s, _obs(5, "p5", a=("B", 0), b=("B", 0), c=("B", 0), d=("B", 0)), cfg)
    f = _formed(ev)
    assert f.clusters == (ClusterInfo("c0", ("a", "b", "c", "d"), "c0"),) and f.retired == ("c2",)
    # Ids follow members, not responses: the same partition with the types swapped keeps its ids.
    s, ev = step(s, _obs(6, "p6", a=("A", 0), b=("A", 0), c=("B", 0), d=("B", 0)), cfg)
    s, ev = step(s, _obs(7, "p7", a=("B", 0), b=("B", 0), c=("A", 0), d=("A", 0)), cfg)
    assert _formed(ev).clusters == (ClusterInfo("c0", ("a", "b"), "c0"), ClusterInfo("c3", ("c", "d"), "c3"))
    assert ClusterState.from_dict(s.to_dict()) == s


def test_reclustering_with_stale_responses_and_no_responses() -> None:
    cfg = DistflConfig(warmup_rounds=0, recluster_every=2, tau=0.2, threshold="fixed")
    s, ev = step(ClusterState(), ClusterObservation(1, {}, SHAPE, "p1"), cfg)
    assert ev == [] and clustering_due(s, 2, cfg)  # nothing on the probe: still due
    s, ev = step(s, _obs(2, "p2", a=("A", 0), b=("A", 0), c=("B", 0), d=("B", 0), e=("C", 0)), cfg)
    assert cluster_members(s) == {"c0": ["a", "b"], "c1": ["c", "d"], "c2": ["e"]}
    s, ev = step(s, _obs(3, "p3", n=("A", 0)), cfg)  # newcomer on another probe: nothing to compare with
    assert ev == [] and cluster_of(s, "n") is None
    # Re-clustering on p4 with only a, b, c (d, e, n stale): a, b (from c0) and c (from c1) merge into c0, c1 is
    # retired and d follows it into c0; e's cluster had no member re-clustered, so it lives on; n stays pending.
    s, ev = step(s, _obs(4, "p4", a=("A", 0), b=("A", 0), c=("A", 0)), cfg)
    f = _formed(ev)
    assert f.clusters == (ClusterInfo("c0", ("a", "b", "c", "d"), "c0"), ClusterInfo("c2", ("e",), "c2"))
    assert f.retired == ("c1",) and f.excluded == ("d", "e", "n")
    assert cluster_of(s, "n") is None


def test_never_recluster_and_malformed_observations() -> None:
    cfg = DistflConfig(warmup_rounds=1, recluster_every=0, tau=0.2)
    s, _ = step(ClusterState(), _obs(1, "p", a=("A", 0)), cfg)
    s, ev = step(s, _obs(2, "p", a=("A", 0), b=("B", 0)), cfg)
    assert _formed(ev).sizes == {"c0": 1, "c1": 1}
    assert not any(clustering_due(s, r, cfg) for r in range(3, 50))
    s, ev = step(s, _obs(30, "p", c=("B", 0.01)), cfg)
    assert len(ev) == 1 and isinstance(ev[0], ClusterAssigned)
    assert (ev[0].client_id, ev[0].cluster_id, ev[0].nearest) == ("c", "c1", "b")
    snapshot = s.to_dict()
    for bad in (ClusterObservation(31, {"z": [0.5, 0.5]}, SHAPE, "p"),
                ClusterObservation(31, {"z": [math.nan] * 6}, SHAPE, "p"),
                ClusterObservation(31, {"z": [-0.1] * 6}, SHAPE, "p"),
                ClusterObservation(31, {"z": [0.0] * 6}, SHAPE, "p"),
                ClusterObservation(31, {"z": [0.25] * 4}, (2, 2), "p")):  # p already has shape (2, 3)
        with pytest.raises(ValueError, match="distfl"):
            step(s, bad, cfg)
        assert s.to_dict() == snapshot
    with pytest.raises(ValueError, match="unknown"):
        ClusterState.from_dict({**snapshot, "bogus": 1})
