"""tools/bench/scaling_model.py's pure functions: the fits, the capacity arithmetic, the shared-machine prediction and
the exactness of the root's combine of shard partial aggregates (no timing, no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from fedcore.aggregation.fixedpoint import FixedPointSum
from tools.bench.scaling_model import (
    Costs,
    bytes_per_client_round,
    capacity,
    combine_fixed_point,
    combine_partials,
    dedicated_round_time,
    fit_line,
    fit_memory,
    fit_round_cpu,
    float32_sum_tolerance,
    mlp_params,
    partial_sum,
    predict_shared,
    server_cpu_per_round,
)


def costs(**over: float) -> Costs:
    base: dict[str, float] = dict(
        fixed_cpu_per_round=0.004, cpu_per_client_round=0.002, cpu_per_param=2e-8, idle_cpu_per_client_s=3e-5,
        client_cpu_per_client_round=0.003, latency=0.01, wire_bytes_fixed=60.0, wire_bytes_per_param=8.0,
        mem_base=300 * 2.0**20, mem_per_connection=50 * 1024.0, mem_per_param=100.0, mem_per_selected_param=4.0,
        bandwidth=3e9,
        memcpy_bandwidth=1e10)
    base.update(over)
    return Costs(**base)


def test_mlp_params_matches_the_synthetic_mlp() -> None:
    assert mlp_params([64]) == 60 * 64 + 64 + 64 * 10 + 10 == 4_554


def test_fit_line_recovers_a_line_and_needs_two_x() -> None:
    c0, c1 = fit_line([1.0, 2.0, 4.0], [3.5, 5.5, 9.5])
    assert c0 == pytest.approx(1.5) and c1 == pytest.approx(2.0)
    with pytest.raises(ValueError):
        fit_line([2.0, 2.0], [1.0, 3.0])


def test_fit_round_cpu_recovers_fixed_per_client_and_per_param_parts() -> None:
    f, a, b = 0.005, 0.0018, 2.5e-8
    samples = [(k, p, f + k * (a + b * p)) for k, p in [(6, 4_554), (24, 4_554), (6, 165_130), (12, 165_130)]]
    got = fit_round_cpu(samples)
    assert got == pytest.approx((f, a, b), rel=1e-6)
    # one model size only: the per-parameter part is not identifiable
    with pytest.raises(ValueError):
        fit_round_cpu([(6, 4_554, 0.02), (24, 4_554, 0.06)])


def test_fit_memory_recovers_base_per_param_and_in_flight_parts() -> None:
    m0, m, mk = 3e8, 180.0, 4.0
    samples = [(k, p, m0 + p * (m + k * mk)) for k, p in [(6, 4_554), (24, 4_554), (6, 165_130), (24, 165_130)]]
    assert fit_memory(samples) == pytest.approx((m0, m, mk), rel=1e-6)
    with pytest.raises(ValueError):
        fit_memory([(6, 4_554, 1.0), (6, 165_130, 2.0)])


def test_server_cpu_and_bytes_follow_the_formula() -> None:
    c = costs()
    assert server_cpu_per_round(c, 1000, 100, 1_000_000, 10.0) == pytest.approx(
        0.004 + 100 * (0.002 + 0.02) + 1000 * 3e-5 * 10.0)
    assert bytes_per_client_round(c, 1_000_000) == 60.0 + 8.0e6


def test_capacity_fills_the_cpu_budget_exactly() -> None:
    c = costs(bandwidth=1e15, mem_per_connection=1.0, mem_per_selected_param=0.0)
    cap = capacity(c, 10.0, 1_000_000, 0.1, ram_bytes=1e15, fd_limit=10**9)
    assert cap.bound == "cpu"
    per = 0.1 * (0.002 + 0.02) + 3e-5 * 10.0
    assert cap.connected == math.floor((10.0 - 0.004) / per)
    assert cap.per_round == math.floor(0.1 * cap.connected)
    # the CPU it needs at that N fits the round; one more client would not
    used = server_cpu_per_round(c, cap.connected, cap.per_round, 1_000_000, 10.0)
    assert used <= 10.0 * (1 + 1e-9)
    assert c.fixed_cpu_per_round + (cap.connected + 1) * per > 10.0


def test_capacity_names_the_binding_resource() -> None:
    c = costs(bandwidth=1e6)  # 1 MB/s: 8 MB per client-round at 1M params
    cap = capacity(c, 10.0, 1_000_000, 1.0, ram_bytes=1e15, fd_limit=10**9)
    assert cap.bound == "bandwidth" and cap.connected == 1
    cap = capacity(costs(), 60.0, 4_554, 0.01, ram_bytes=1e15, fd_limit=500)
    assert cap.bound == "sockets" and cap.connected == 500
    # memory: (RAM - M0 - P m) / (m_conn + f P m_K)
    c = costs(bandwidth=1e15)
    cap = capacity(c, 600.0, 10_000_000, 1.0, ram_bytes=2e9, fd_limit=10**9)
    assert cap.bound == "memory"
    assert cap.connected == math.floor((2e9 - c.mem_base - 1e9) / (50 * 1024.0 + 1e7 * 4.0))
    with pytest.raises(ValueError):
        capacity(costs(), 10.0, 1, 0.0, 1e9, 10)


def test_predict_shared_is_brents_bound_plus_latency() -> None:
    c = costs(idle_cpu_per_client_s=0.0)
    srv = 0.004 + 48 * (0.002 + 2e-8 * 4_554)
    cli = 48 * 0.003
    one = predict_shared(c, 1, 48, 48, 4_554, cores=2.0, hosts_per_shard=2)
    span = max(srv, cli / 2)
    assert one.round_s == pytest.approx(0.01 + span + (srv + cli - span) / 2.0)
    assert one.server_cpu == pytest.approx(srv)
    two = predict_shared(c, 2, 24, 24, 4_554, cores=2.0, hosts_per_shard=2)
    srv2, cli2 = 0.004 + 24 * (0.002 + 2e-8 * 4_554), 24 * 0.003
    span2 = max(srv2, cli2 / 2)
    assert two.round_s == pytest.approx(0.01 + span2 + (2 * (srv2 + cli2) - span2) / 2.0)
    assert two.client_rounds_per_s == pytest.approx(48 / two.round_s)
    # with one core there is nothing to overlap: the round is all the work plus L
    solo = predict_shared(c, 2, 24, 24, 4_554, cores=1.0, hosts_per_shard=2)
    assert solo.round_s == pytest.approx(0.01 + 2 * (srv2 + cli2))


def test_idle_clients_cost_a_fixed_point_of_the_round() -> None:
    c = costs()
    t = dedicated_round_time(c, 10_000, 100, 4_554, client_seconds=5.0)
    assert t == pytest.approx(c.latency + 5.0 + server_cpu_per_round(c, 10_000, 100, 4_554, t), rel=1e-9)
    assert t > dedicated_round_time(c, 100, 100, 4_554, client_seconds=5.0)


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_combined_partial_sums_equal_fedavg_within_float32_rounding(shards: int) -> None:
    g = torch.Generator().manual_seed(shards)
    k, p = 60, 4_096
    updates = torch.randn(k, p, generator=g) * torch.logspace(-3, 1, p)
    weights = torch.randint(1, 500, (k,), generator=g).to(torch.float32)
    parts = [partial_sum(updates[s::shards], weights[s::shards]) for s in range(shards)]
    combined = combine_partials(parts).to(torch.float64)
    # FedAvg over all K updates in float32 (what one coordinator computes without the exact sum)
    norm = (weights / weights.sum())[:, None] * updates
    fedavg32 = norm.sum(dim=0).to(torch.float64)
    exact = (weights.to(torch.float64)[:, None] * updates.to(torch.float64)).sum(0) / weights.to(torch.float64).sum()
    # the combine: a float64 sum (K roundings of at most 2^-53 of the partial sums' magnitudes) rounded once to
    # float32 (half an ulp: 2^-24 relative)
    mag = (weights.to(torch.float64)[:, None] * updates.to(torch.float64)).abs().sum(0) / weights.sum()
    f64 = (k + shards) * 2.0**-53 * mag
    assert bool(((combined - exact).abs() <= exact.abs() * 2.0**-24 + 2 * f64).all())
    # float32 FedAvg: each term's two roundings (w / Σw, times u) and the K-term float32 sum
    tol = float32_sum_tolerance(norm, roundings_per_term=2)
    assert bool(((fedavg32 - combined).abs() <= tol + exact.abs() * 2.0**-24 + 2 * f64).all())


def test_a_lost_shard_breaks_the_combine() -> None:
    """The check above can fail: dropping a shard's partial (or its weight) moves the mean far outside it."""
    g = torch.Generator().manual_seed(0)
    updates = torch.randn(40, 512, generator=g) + 1.0
    weights = torch.ones(40)
    parts = [partial_sum(updates[s::4], weights[s::4]) for s in range(4)]
    exact = updates.to(torch.float64).mean(0)
    tol = float32_sum_tolerance(updates / 40) + exact.abs() * 2.0**-24
    assert bool(((combine_partials(parts).to(torch.float64) - exact).abs() <= tol).all())
    assert not bool(((combine_partials(parts[:3]).to(torch.float64) - exact).abs() <= tol).all())
    with pytest.raises(ValueError):
        combine_partials([])


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_fixed_point_partials_combine_bit_for_bit(shards: int) -> None:
    g = torch.Generator().manual_seed(10 + shards)
    k, p = 24, 70_000  # more than one fixed-point chunk
    updates = torch.randn(k, p, generator=g)
    weights = torch.randint(1, 100, (k,), generator=g).tolist()
    whole = FixedPointSum(p, workers=1)
    for u, w in zip(updates, weights, strict=True):
        whole.add(u, float(w))
    parts = []
    for s in range(shards):
        part = FixedPointSum(p, workers=1)
        for j in range(s, k, shards):
            part.add(updates[j], float(weights[j]))
        parts.append(part)
    root = combine_fixed_point(parts)
    assert root.count == k
    assert torch.equal(root.hi, whole.hi) and torch.equal(root.lo, whole.lo)
    assert torch.equal(root.value(float(sum(weights))), whole.value(float(sum(weights))))
    if shards > 1:  # a missing shard changes the sum
        assert not torch.equal(combine_fixed_point(parts[1:]).hi, whole.hi)


def test_fixed_point_combine_refuses_mismatched_sizes() -> None:
    with pytest.raises(ValueError):
        combine_fixed_point([FixedPointSum(4, workers=1), FixedPointSum(5, workers=1)])
    with pytest.raises(ValueError):
        combine_fixed_point([])
