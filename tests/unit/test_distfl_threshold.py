"""DistFL's automatic threshold (issue 28, beyond the paper): single-linkage merge heights, the largest-gap cut and
the silhouette-chosen cut, pinned on hand-computed distances; and the state machine using them."""

from __future__ import annotations

from fractions import Fraction

import pytest

from fedcore.config import ConfigError
from fedcore.distfl import (
    ClusterFormed,
    ClusterObservation,
    ClusterState,
    DistflConfig,
    choose_threshold,
    gap_threshold,
    kl_matrix,
    link_components,
    mean_silhouette,
    silhouette_threshold,
    single_link_merges,
    step,
)

# Two groups, A = {0, 1, 2} and B = {3, 4}. Symmetrised link distance d = min(p, pᵀ):
#       0      1      2      3      4
#  0    -    1/8    1/2     2      2
#  1           -    3/8     2      2
#  2                  -     1      2
#  3                         -    1/4
# p is asymmetric on purpose: p[1][0] = 3 but p[0][1] = 1/8, so d(0, 1) = 1/8 (the link rule's "either way").
# Every value is dyadic, so sums and halvings below are exact in binary floating point.
P = [
    [0.0, 0.125, 0.5, 2.0, 2.0],
    [3.0, 0.0, 0.375, 2.0, 2.0],
    [0.5, 0.375, 0.0, 1.0, 2.0],
    [2.0, 4.0, 1.0, 0.0, 0.25],
    [2.0, 2.0, 2.0, 0.25, 0.0],
]
TRUTH = [[0, 1, 2], [3, 4]]


def test_merge_heights_are_the_minimum_spanning_tree_of_the_link_distance() -> None:
    # Kruskal by hand: 1/8 (0-1), 1/4 (3-4), 3/8 (1-2), 1/2 (0-2: cycle, skipped), 1 (2-3), the rest cycles.
    assert single_link_merges(P) == [0.125, 0.25, 0.375, 1.0]
    # k heights below tau <=> n - k components, for every tau between and at the heights.
    for tau, n_comp in [(0.1, 5), (0.125, 5), (0.2, 4), (0.3, 3), (0.5, 2), (1.0, 2), (1.01, 1)]:
        assert len(link_components(P, tau)) == n_comp


def test_gap_threshold_cuts_at_the_largest_gap_between_merge_heights() -> None:
    # Gaps between consecutive heights: 1/8, 1/8, 5/8 -> cut between 3/8 and 1, tau = (3/8 + 1) / 2 = 11/16.
    tau = gap_threshold(P, fallback=0.2)
    assert tau == 0.6875
    assert link_components(P, tau) == TRUTH
    # The fixed tau = 0.2 the issue started from over-splits the same matrix: only 0-1 is linked below it.
    assert link_components(P, 0.2) == [[0, 1], [2], [3], [4]]


def test_gap_ties_take_the_lower_cut_and_degenerate_inputs_fall_back() -> None:
    # Heights 1, 2, 3 (a chain 0-1-2-3): gaps 1 and 1, the lower cut (between 1 and 2) wins -> tau = 3/2.
    chain = [[0.0, 1.0, 9.0, 9.0], [1.0, 0.0, 2.0, 9.0], [9.0, 2.0, 0.0, 3.0], [9.0, 9.0, 3.0, 0.0]]
    assert single_link_merges(chain) == [1.0, 2.0, 3.0]
    assert gap_threshold(chain, fallback=0.2) == 1.5
    # Two clients (one height) or equal heights: nothing to choose, the fixed tau comes back.
    assert gap_threshold([[0.0, 5.0], [5.0, 0.0]], fallback=0.2) == 0.2
    equal = [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    assert gap_threshold(equal, fallback=0.3) == 0.3
    assert silhouette_threshold(equal, fallback=0.3) == 0.3
    assert gap_threshold([[0.0]], fallback=0.4) == 0.4


def test_nan_is_no_link_for_the_merge_heights() -> None:
    nan = float("nan")
    p = [[0.0, 0.5, nan], [0.5, 0.0, nan], [nan, nan, 0.0]]
    assert single_link_merges(p) == [0.5]
    assert link_components(p, 1e9) == [[0, 1], [2]]


def test_mean_silhouette_against_a_hand_computation() -> None:
    d = [[min(P[i][j], P[j][i]) for j in range(5)] for i in range(5)]
    # Partition {0,1,2} {3,4}: s(i) = (b - a) / max(a, b) with a, b the mean distances inside / to the other group.
    # s0: a = (1/8 + 1/2)/2 = 5/16, b = 2 -> 27/32; s1: a = 1/4, b = 2 -> 7/8; s2: a = 7/16, b = 3/2 -> 17/24;
    # s3: a = 1/4, b = 5/3 -> 17/20; s4: a = 1/4, b = 2 -> 7/8.
    two = (Fraction(27, 32) + Fraction(7, 8) + Fraction(17, 24) + Fraction(17, 20) + Fraction(7, 8)) / 5
    # Partition {0,1} {2} {3,4}: s0 = 3/4, s1 = 2/3, s2 = 0 (singleton), s3 = 3/4, s4 = 7/8.
    three = (Fraction(3, 4) + Fraction(2, 3) + 0 + Fraction(3, 4) + Fraction(7, 8)) / 5
    # Each s(i) is a few float operations on dyadic inputs (relative error a few 2^-53), mean of 5: 1e-15 is ample.
    assert mean_silhouette(d, [0, 0, 0, 1, 1]) == pytest.approx(float(two), abs=1e-15)
    assert mean_silhouette(d, [0, 0, 1, 2, 2]) == pytest.approx(float(three), abs=1e-15)
    with pytest.raises(ValueError, match="two clusters"):
        mean_silhouette(d, [0] * 5)


def test_silhouette_threshold_picks_the_best_scored_cut() -> None:
    # Candidate cuts leaving 2..n-1 clusters: tau = 3/16 (4 clusters), 5/16 (3 clusters), 11/16 (2 clusters, the
    # truth); the two-cluster cut scores 0.830 against 0.608 for three (previous test) and less for four.
    tau = silhouette_threshold(P, fallback=0.2)
    assert tau == 0.6875
    assert link_components(P, tau) == TRUTH


def test_choose_threshold_dispatches_and_refuses_unknown_methods() -> None:
    assert choose_threshold(P, "fixed", 0.2) == 0.2
    assert choose_threshold(P, "gap", 0.2) == 0.6875
    assert choose_threshold(P, "silhouette", 0.2) == 0.6875
    with pytest.raises(ValueError, match="unknown method"):
        choose_threshold(P, "largest", 0.2)
    c = DistflConfig(threshold="largest")
    with pytest.raises(ConfigError, match=r"^distfl\.threshold: "):
        c.validate()
    assert DistflConfig().threshold == "guarded"  # the default since issue 49


def test_state_machine_clusters_with_the_automatic_threshold_and_records_it() -> None:
    # Responses [1, 2]: two types, three clients each, with small wobbles inside a type; the within-type KLs are
    # above the fixed tau, so "fixed" over-splits while "gap" finds the two types.
    def resp(a: float) -> list[float]:
        return [a, 1.0 - a]

    values = {"a1": resp(0.70), "a2": resp(0.80), "a3": resp(0.90), "b1": resp(0.10), "b2": resp(0.20),
              "b3": resp(0.30)}
    obs = ClusterObservation(1, values, (1, 2), "p1")
    fixed = DistflConfig(warmup_rounds=0, tau=0.02, threshold="fixed")
    _, ev = step(ClusterState(), obs, fixed)
    assert isinstance(ev[0], ClusterFormed) and len(ev[0].clusters) > 2 and ev[0].tau == 0.02
    auto = DistflConfig(warmup_rounds=0, tau=0.02, threshold="gap")
    _, ev = step(ClusterState(), obs, auto)
    formed = ev[0]
    assert isinstance(formed, ClusterFormed)
    assert [c.members for c in formed.clusters] == [("a1", "a2", "a3"), ("b1", "b2", "b3")]
    ids = sorted(values)
    assert formed.tau == gap_threshold(kl_matrix([values[c] for c in ids]).tolist(), 0.02)
