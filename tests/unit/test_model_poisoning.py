"""Model-poisoning attacks (fedcore.attacks.model_poisoning) and the full-knowledge harness, on small tensors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from fedcore.aggregation import AggregationConfig, BufferedAggregator
from fedcore.aggregation.rules import Krum, Median, TrimmedMean, build_rule
from fedcore.attacks import AttackConfig, AttackError, UpdateContext, poison_update
from fedcore.attacks.harness import SimulationHarnessConfig, full_knowledge_rows, harness_seed
from fedcore.attacks.model_poisoning import (
    deviation,
    dyn_opt,
    flat_update,
    halving_search,
    model_replacement,
    shard_indices,
    stat_opt,
    weights_from_update,
)
from fedcore.config import ConfigError, ServerConfig, build_config, from_dict


def test_model_replacement_scales_the_malicious_update() -> None:
    assert torch.equal(model_replacement(torch.tensor([1.0, -2.0, 0.5]), 3.0), torch.tensor([3.0, -6.0, 1.5]))


BENIGN = torch.tensor([[1.0, -1.0, 2.0, -4.0],
                       [3.0, -3.0, 4.0, -2.0]])


def test_stat_opt_full_knowledge_by_hand() -> None:
    """mu = [2, -2, 3, -3]: s = +, -, +, -. w_min = [1, -3, 2, -4], w_max = [3, -1, 4, -2]; b = 2:
    coord 0 (s>0, w_min>0): [w_min/b, w_min] = [0.5, 1]; coord 1 (s<0, w_max<=0): [w_max, w_max/b] = [-1, -0.5];
    coord 2: [1, 2]; coord 3 (s<0, w_max<=0): [-2, -1]."""
    lo = torch.tensor([0.5, -1.0, 1.0, -2.0], dtype=torch.float64)
    hi = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    out = stat_opt(BENIGN, 2, torch.Generator().manual_seed(7), b=2.0, knowledge="full")
    g = torch.Generator().manual_seed(7)
    expected = torch.stack([(lo + (hi - lo) * torch.rand(4, generator=g, dtype=torch.float64)).float()
                            for _ in range(2)])
    assert torch.equal(out, expected)
    assert not torch.equal(out[0], out[1])  # each attacker draws its own values
    # Positive extremes on the s<0 side: [w_max, b*w_max].
    pos = stat_opt(torch.tensor([[-1.0], [0.5]]), 1, torch.Generator().manual_seed(0), b=2.0)
    assert 0.5 <= float(pos[0, 0]) <= 1.0


def test_stat_opt_partial_knowledge_uses_mu_and_three_to_four_sigma() -> None:
    sigma = BENIGN.double().std(dim=0)
    mu = BENIGN.double().mean(dim=0)
    out = stat_opt(BENIGN, 50, torch.Generator().manual_seed(1), knowledge="partial").double()
    up = mu >= 0
    lo = torch.where(up, mu - 4 * sigma, mu + 3 * sigma)
    hi = torch.where(up, mu - 3 * sigma, mu + 4 * sigma)
    assert bool(((out >= lo - 1e-6) & (out <= hi + 1e-6)).all())
    with pytest.raises(ValueError, match="knowledge"):
        stat_opt(BENIGN, 1, torch.Generator(), knowledge="psychic")


def test_deviation_directions() -> None:
    assert torch.allclose(deviation(BENIGN, "std"), BENIGN.std(dim=0))
    assert torch.equal(deviation(BENIGN, "sign"), torch.tensor([1.0, -1.0, 1.0, -1.0]))
    mu = BENIGN.mean(dim=0)
    assert torch.allclose(deviation(BENIGN, "unit"), mu / mu.norm())


def test_halving_search_stops_at_the_largest_accepted_gamma() -> None:
    for star in (0.3, 3.7, 9.99, 17.5):
        def below(g: float, s: float = star) -> bool:
            return g <= s

        got = halving_search(below, 10.0, 1e-5)
        assert got <= star and star - got <= 2e-5, (star, got)
    assert halving_search(lambda g: False, 10.0, 1e-5) == 0.0
    tried: list[float] = []

    def record(g: float) -> bool:
        tried.append(g)
        return True

    halving_search(record, 10.0, 1e-3)
    assert tried[0] == 10.0  # the search starts at gamma = 10


def _benign(n: int = 8, p: int = 30, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, p, generator=g) * 0.1 + 0.05


def test_dyn_opt_against_krum_sends_the_largest_gamma_krum_still_selects() -> None:
    benign, m = _benign(), 2
    rule = Krum(f=m)
    res = dyn_opt(benign, m, rule, dev_type="std", gamma_init=10.0, tol=1e-4)
    mu, dev = benign.double().mean(0).float(), deviation(benign, "std")
    assert torch.equal(res.update, mu - res.gamma * dev)

    def selected(gamma: float) -> bool:
        rows = torch.cat([(mu - gamma * dev).expand(m, -1), benign])
        sel = rule(rows, torch.ones(len(rows), dtype=torch.float64)).selected
        return sel is not None and sel[0] < m

    assert res.gamma > 0 and selected(res.gamma)
    assert not selected(res.gamma + 1e-3)  # a bit larger and Krum no longer picks it


def test_dyn_opt_against_trimmed_mean_pushes_the_aggregate_away_from_the_mean() -> None:
    benign, m = _benign(), 2
    rule = TrimmedMean(trim_m=m)
    res = dyn_opt(benign, m, rule)
    mu = benign.double().mean(0)
    rows = torch.cat([res.update.expand(m, -1), benign])
    agg = rule(rows, torch.ones(len(rows), dtype=torch.float64)).step.double()
    assert math.isclose(res.deviation_norm, float((agg - mu).norm()), rel_tol=1e-9)
    honest = rule(torch.cat([benign[:m], benign]), torch.ones(len(rows), dtype=torch.float64)).step.double()
    assert res.deviation_norm > float((honest - mu).norm())
    assert res.gamma > 0
    # The median is attacked the same way.
    assert dyn_opt(benign, m, Median()).gamma > 0


def test_flat_update_round_trips_through_weights() -> None:
    received = {"w": torch.ones(2, 2), "count": torch.tensor(3), "b": torch.zeros(3)}
    trained = {"w": torch.full((2, 2), 1.5), "count": torch.tensor(9), "b": torch.tensor([1.0, 2.0, 3.0])}
    u = flat_update(trained, received)
    assert torch.equal(u, torch.tensor([0.5, 0.5, 0.5, 0.5, 1.0, 2.0, 3.0]))
    back = weights_from_update(received, u)
    assert torch.equal(back["w"], trained["w"]) and torch.equal(back["b"], trained["b"])
    assert int(back["count"]) == 3  # non-float tensors come from the received model


def test_shards_are_a_seeded_disjoint_split() -> None:
    parts = shard_indices(10, 4, 5)
    assert sorted(torch.cat(parts).tolist()) == list(range(10)) and len(parts) == 4
    assert all(torch.equal(a, b) for a, b in zip(parts, shard_indices(10, 4, 5), strict=True))
    assert len(shard_indices(3, 4, 5)) == 3


def test_the_update_hook_by_kind_and_knowledge() -> None:
    asked: list[torch.Tensor] = []

    def honest(idx: torch.Tensor) -> torch.Tensor:
        asked.append(idx)
        return torch.full((4,), float(len(asked)))

    ctx = UpdateContext(received={"w": torch.zeros(4)}, trained={"w": torch.ones(4)}, num_train=8, seed=11,
                        honest_update=honest)
    assert poison_update(AttackConfig(), ctx) is None
    assert poison_update(AttackConfig(kind="label_flip"), ctx) is None
    assert poison_update(AttackConfig(kind="dyn_opt", knowledge="full"), ctx) is None
    rep = poison_update(AttackConfig(kind="model_replacement", options={"boost": 4.0}), ctx)
    assert rep is not None and torch.equal(rep.weights["w"], torch.full((4,), 4.0))
    dyn = poison_update(AttackConfig(kind="dyn_opt", options={"estimate_shards": 4, "assumed_attackers": 1}), ctx)
    assert dyn is not None and len(asked) == 4
    benign = torch.stack([torch.full((4,), float(i)) for i in (1, 2, 3, 4)])
    expected = dyn_opt(benign, 1, TrimmedMean(trim_m=1))
    assert torch.equal(dyn.weights["w"], expected.update) and dyn.metrics["attack_gamma"] == expected.gamma
    asked.clear()
    stat = poison_update(AttackConfig(kind="stat_opt", options={"estimate_shards": 4}), ctx)
    assert stat is not None and bool((stat.weights["w"] < 0).all())  # mu > 0: pushed below mu - 3 sigma


def test_attack_options_are_validated_with_the_field_named() -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"kind": "dyn_opt", "knowledge": "some"}, "attack.knowledge"),
        ({"kind": "dyn_opt", "dev_type": "cos"}, "attack.options.dev_type"),
        ({"kind": "model_replacement", "boost": 0.0}, "attack.options.boost"),
        ({"kind": "stat_opt", "stat_b": 0.5}, "attack.options.stat_b"),
        ({"kind": "dyn_opt", "gamma_init": -1.0}, "attack.options.gamma_init"),
        ({"kind": "dyn_opt", "estimate_shards": 1}, "attack.options.estimate_shards"),
        ({"kind": "dyn_opt", "assumed_rule": "nope"}, "attack.options.assumed_rule"),
        ({"kind": "dyn_opt", "assumed_rule": "krum", "estimate_shards": 2}, "attack.options.assumed_rule"),
        ({"kind": "stat_opt", "dev_type": "unit"},
         "attack.options.dev_type: attack 'stat_opt' has no option 'dev_type'"),
        ({"kind": "poison_everything"}, "attack.kind"),
    ]
    for table, field in bad:
        flat = {k: v for k, v in table.items() if k not in ("kind", "knowledge")}
        shapes = [table] + ([{"kind": table["kind"], "options": flat}] if flat else [])
        for shape in shapes:  # the old flat keys and the kind's options table fail alike, naming the new key
            with pytest.raises(ValueError, match=field):
                from_dict(AttackConfig, shape, "attack")
        if flat and "has no option" not in field:
            with pytest.raises(AttackError, match=rf"^{field}"):
                AttackConfig(kind=table["kind"], options=flat)
    assert AttackConfig(kind="model_replacement").flips_labels
    assert AttackConfig(kind="stat_opt").poisons_model and not AttackConfig(kind="stat_opt").flips_labels


# ---- the full-knowledge harness ----

def test_full_knowledge_rows_replace_only_the_attackers() -> None:
    rows = torch.cat([_benign(6), torch.full((2, 30), 99.0)])
    keys = [f"c{i}" for i in range(8)]
    attack = AttackConfig(kind="stat_opt", knowledge="full")
    rule = build_rule(AggregationConfig(rule="trimmed_mean", options={"trim_m": 2}))
    out = full_knowledge_rows(rows, keys, {"c6", "c7"}, attack, rule, seed=3)
    assert out is not None and out.positions == (6, 7)
    expected = stat_opt(rows[:6], 2, torch.Generator().manual_seed(3), knowledge="full")
    assert torch.equal(out.rows, expected)  # crafted from the benign rows only (the attackers' own are ignored)
    assert full_knowledge_rows(rows, keys, set(), attack, rule, seed=3) is None
    assert full_knowledge_rows(rows[6:], keys[6:], {"c6", "c7"}, attack, rule, seed=3) is None
    dyn = full_knowledge_rows(rows, keys, {"c0"}, AttackConfig(kind="dyn_opt", knowledge="full"), rule, 3)
    assert dyn is not None and dyn.positions == (0,) and dyn.gamma > 0
    assert harness_seed(1, 2, ["b", "a"]) == harness_seed(1, 2, ["a", "b"])


def test_buffered_aggregator_replace_row_validates_and_clips() -> None:
    agg = BufferedAggregator(AggregationConfig(rule="median", clip_norm=1.0, max_update_norm=100.0), 3, 3)
    agg.add(torch.tensor([0.1, 0.0, 0.0]), 1.0, "b")
    agg.add(torch.tensor([0.2, 0.0, 0.0]), 1.0, "a")
    agg.canonical_order()
    assert agg.keys == ["a", "b"]
    agg.replace_row(1, torch.tensor([3.0, 4.0, 0.0]))
    assert torch.allclose(agg.rows[1], torch.tensor([0.6, 0.8, 0.0]))  # clipped to norm 1
    with pytest.raises(ValueError):
        agg.replace_row(0, torch.tensor([300.0, 0.0, 0.0]))  # above max_update_norm: refused, row kept
    assert torch.allclose(agg.rows[0], torch.tensor([0.2, 0.0, 0.0]))
    with pytest.raises(ValueError, match="filled row"):
        agg.replace_row(2, torch.zeros(3))


def _server(**sections: dict[str, Any]) -> ServerConfig:
    overrides = [([s, k], v) for s, values in sections.items() for k, v in values.items()]
    return build_config(ServerConfig, None, overrides)


def test_the_harness_is_off_by_default_and_refused_outside_simulation(tmp_path: Any) -> None:
    assert not ServerConfig().simulation_harness.full_knowledge_adversary
    assert SimulationHarnessConfig().attack.knowledge == "full"
    on = {"full_knowledge_adversary": True}
    cfg = _server(security={"insecure": True}, simulation_harness=on, aggregation={"rule": "trimmed_mean"})
    assert cfg.simulation_harness.full_knowledge_adversary
    cert, key, ca = (tmp_path / n for n in ("s.pem", "s.key", "ca.pem"))
    for p in (cert, key, ca):
        p.write_text("x")
    with pytest.raises(ConfigError, match=r"simulation_harness\.full_knowledge_adversary.*production"):
        _server(security={"tls_cert": str(cert), "tls_key": str(key)}, simulation_harness=on)
    with pytest.raises(ConfigError, match=r"simulation_harness\.full_knowledge_adversary"):
        _server(security={"tls_cert": str(cert), "tls_key": str(key), "client_ca": str(ca)},
                simulation_harness=on)
    with pytest.raises(ConfigError, match=r"simulation_harness\.attack.kind"):
        _server(security={"insecure": True},
                simulation_harness={**on, "attack": {"kind": "label_flip", "knowledge": "full"}})
    with pytest.raises(ConfigError, match=r"simulation_harness\.attack.knowledge"):
        _server(security={"insecure": True}, simulation_harness={**on, "attack": {"kind": "dyn_opt"}})


def test_the_oracle_defender_trims_the_rounds_attacker_count() -> None:
    from fedcore.attacks.harness import oracle_trimmed_mean

    tm = TrimmedMean(trim_m=2)
    assert isinstance(oracle_trimmed_mean(tm, 10, 3), TrimmedMean)
    assert oracle_trimmed_mean(tm, 10, 3).m(10) == 3  # type: ignore[attr-defined]
    assert oracle_trimmed_mean(tm, 10, 1).m(10) == 2  # type: ignore[attr-defined]  # never below the configured m
    assert oracle_trimmed_mean(tm, 10, 7).m(10) == 4  # type: ignore[attr-defined]  # capped at (n - 1) // 2
    krum = Krum(f=2)
    assert oracle_trimmed_mean(krum, 10, 5) is krum
    agg = BufferedAggregator(AggregationConfig(rule="trimmed_mean", options={"trim_m": 1}), 2, 5)
    for i in range(5):
        agg.add(torch.tensor([float(i), 0.0]), 1.0, f"c{i}")
    agg.use_rule(TrimmedMean(trim_m=2))
    assert float(agg.finalize(torch.zeros(2)).new_global[0]) == 2.0  # only the median value is left
    with pytest.raises(ValueError, match="trim_m"):
        agg.use_rule(TrimmedMean(trim_m=3))


def test_the_client_cli_offers_every_attack_kind() -> None:
    from fedclient.cli import ATTACK_KINDS
    from fedcore.attacks.poisoning import ATTACKS

    assert tuple(ATTACKS.names()) == ATTACK_KINDS
