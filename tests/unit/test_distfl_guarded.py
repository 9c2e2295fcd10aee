"""DistFL's guarded threshold (issue 49): cut at the largest merge-height gap only when it splits off groups and
is significant, else one cluster; and the committed comparison table (docs/results/distfl_default/*.json)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedcore import distfl
from fedcore.config import ConfigError
from fedcore.distfl.similarity import guarded_cut

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "distfl_default"


def _symmetric(n: int, value: float | Callable[[int, int], float]) -> list[list[float]]:
    """An n x n matrix with 0 on the diagonal and ``value(i, j)`` (i < j) mirrored."""
    p = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            p[i][j] = p[j][i] = float(value(i, j) if callable(value) else value)
    return p


def _uniform(n: int, seed: int) -> list[list[float]]:
    """An n x n matrix of seeded U(0, 1) draws."""
    return torch.rand((n, n), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()


def _groups(p: list[list[float]], method: str, tau: float = 0.2) -> list[list[int]]:
    return distfl.link_components(p, distfl.choose_threshold(p, method, tau))


def _two_groups(n_a: int, n_b: int, seed: int) -> list[list[float]]:
    """Within a group: U(0.1, 0.3) (seeded); across: U(1.5, 2.0)."""
    n = n_a + n_b
    u = _uniform(n, seed)
    return _symmetric(n, lambda i, j: (0.1 + 0.2 * u[i][j]) if (i < n_a) == (j < n_a)
                      else (1.5 + 0.5 * u[i][j]))


def _iid(n: int, seed: int) -> list[list[float]]:
    """No structure: every distance an i.i.d. draw, uniform on (0.2, 1.0) (seeded), asymmetric as KL is."""
    g = torch.Generator().manual_seed(seed)
    p = (0.2 + 0.8 * torch.rand((n, n), generator=g, dtype=torch.float64))
    p.fill_diagonal_(0.0)
    return p.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_clear_two_group_matrix_is_cut_into_the_groups(seed: int) -> None:
    p = _two_groups(8, 12, seed)
    assert _groups(p, "guarded") == [list(range(8)), list(range(8, 20))]
    # on a clear structure the guarded cut is the gap rule's
    assert distfl.choose_threshold(p, "guarded", 0.2) == distfl.choose_threshold(p, "gap", 0.2)
    assert 0.3 < distfl.guarded_threshold(p, 0.2) < 1.5


def test_four_groups_are_found_whole() -> None:
    # 4 groups of 5 at within 0.1-0.2, across 2 + 0.1 * |ga - gb| (so the across merges differ slightly)
    p = _symmetric(20, lambda i, j: 0.1 + 0.1 * ((i + j) % 3) / 2 if i // 5 == j // 5
                   else 2.0 + 0.1 * abs(i // 5 - j // 5))
    assert _groups(p, "guarded") == [list(range(k, k + 5)) for k in range(0, 20, 5)]


@pytest.mark.parametrize("seed", range(6))
def test_iid_distances_with_no_structure_stay_one_cluster(seed: int) -> None:
    p = _iid(30, seed)
    assert _groups(p, "guarded") == [list(range(30))]
    assert guarded_cut(p) is None
    assert distfl.guarded_threshold(p, 0.2) == pytest.approx(2 * distfl.single_link_merges(p)[-1])
    # the gap rule always cuts somewhere: the guard is what keeps the fleet whole
    assert len(_groups(p, "gap")) >= 2


def test_on_iid_distances_the_silhouette_refuses_a_cut_into_groups() -> None:
    # seed 0: the largest gap leaving two clusters of >= 3 exists (step 1) but scores far below 0.65 (step 2)
    p = _iid(30, 0)
    weighed = guarded_cut(p, min_silhouette=-1.0)
    assert weighed is not None
    lower, upper, score = weighed
    assert lower < upper and score < 0.3 < distfl.GUARD_SILHOUETTE
    assert guarded_cut(p) is None


def test_an_outlying_client_is_not_a_group() -> None:
    # 29 clients at U(0.1, 0.2) from each other, one at 3.0 from all: a huge but single-client gap
    u = _uniform(30, 7)
    p = _symmetric(30, lambda i, j: 3.0 if j == 29 else 0.1 + 0.1 * u[i][j])
    assert _groups(p, "gap") == [list(range(29)), [29]]
    # step 1 passes over the outlier's gap (one client is no group); the best cut into groups of >= 3 is a tiny gap
    # inside the 29 (silhouette below 0), refused by step 2
    weighed = guarded_cut(p, min_silhouette=-1.0)
    assert weighed is not None and weighed[1] < 0.2 and weighed[2] < 0
    assert _groups(p, "guarded") == [list(range(30))]


def test_two_groups_and_an_outlier_keep_the_groups() -> None:
    # groups 0-9 and 10-19 (within U(0.1, 0.2), across 2.0), client 20 at 5.0 from everyone: the largest gap splits
    # the outlier off alone, the guard looks past it to the cut that separates the groups (the outlier stays apart)
    u = _uniform(21, 3)

    def d(i: int, j: int) -> float:
        if j == 20:
            return 5.0
        return 0.1 + 0.1 * u[i][j] if (i < 10) == (j < 10) else 2.0
    p = _symmetric(21, d)
    assert _groups(p, "gap") == [list(range(20)), [20]]
    assert _groups(p, "guarded") == [list(range(10)), list(range(10, 20)), [20]]


def test_overlapping_groups_are_refused() -> None:
    # two groups whose across distances U(0.5, 1.0) overlap the within ones U(0.1, 0.9): the nearest-neighbour
    # chains still split them at a gap, but the split is no clear structure
    u = _uniform(16, 5)
    p = _symmetric(16, lambda i, j: 0.1 + 0.8 * u[i][j] if (i < 8) == (j < 8) else 0.5 + 0.5 * u[i][j])
    weighed = guarded_cut(p, min_silhouette=-1.0)
    assert weighed is not None and weighed[2] < distfl.GUARD_SILHOUETTE
    assert _groups(p, "guarded") == [list(range(16))]
    # min_silhouette is the knob: with -1 any cut into two groups of >= 3 is accepted
    assert len(distfl.link_components(p, distfl.guarded_threshold(p, 0.2, min_silhouette=-1.0))) >= 2


@pytest.mark.parametrize("n", [0, 1, 2])
def test_two_or_fewer_clients_fall_back_to_tau_as_the_other_rules(n: int) -> None:
    p = _symmetric(n, 0.7)
    for method in ("gap", "silhouette", "guarded"):
        assert distfl.choose_threshold(p, method, 0.2) == 0.2


def test_all_heights_equal_falls_back_and_small_fleets_stay_whole() -> None:
    assert distfl.choose_threshold(_symmetric(6, 0.4), "guarded", 0.2) == 0.2  # one distinct height: fallback
    # 5 clients cannot hold two groups of GUARD_MIN_GROUP = 3: one cluster, tau = 2 x the top merge height
    p = _symmetric(5, lambda i, j: 0.1 if (i < 2) == (j < 2) else 2.0)
    assert distfl.GUARD_MIN_GROUP == 3
    assert distfl.guarded_threshold(p, 0.2) == pytest.approx(4.0)
    assert _groups(p, "guarded") == [list(range(5))]
    # identical clients: every height 0, nothing to cut, and 2 x 0 is no threshold: the fallback
    assert distfl.choose_threshold(_symmetric(4, 0.0), "guarded", 0.2) == 0.2


def test_guarded_is_a_valid_threshold_and_the_default() -> None:
    assert "guarded" in distfl.THRESHOLDS
    assert distfl.DistflConfig().threshold == "guarded"
    distfl.DistflConfig(threshold="guarded").validate()
    with pytest.raises(ConfigError, match=r"distfl\.threshold: must be one of .*'guarded'"):
        distfl.DistflConfig(threshold="guard").validate()


# ---- the committed comparison table (docs/results/distfl_threshold.md, "Issue 49: the default") ----

# (case file stem) -> rule -> (ARI rounded to 3 decimals, number of clusters), fixed at tau = 0.2
TABLE: dict[str, dict[str, tuple[float, int]]] = {
    "mnist_types_s0": {"fixed": (0.875, 6), "gap": (1.0, 4), "silhouette": (0.911, 5), "guarded": (1.0, 4)},
    "mnist_types_s1": {"fixed": (0.887, 6), "gap": (1.0, 4), "silhouette": (1.0, 4), "guarded": (1.0, 4)},
    "mnist_flip_s0": {"fixed": (0.496, 13), "gap": (1.0, 2), "silhouette": (1.0, 2), "guarded": (1.0, 2)},
    "mnist_flip_s1": {"fixed": (0.39, 19), "gap": (1.0, 2), "silhouette": (1.0, 2), "guarded": (1.0, 2)},
    "cifar_types_s0": {"fixed": (0.417, 15), "gap": (1.0, 5), "silhouette": (1.0, 5), "guarded": (1.0, 5)},
    "cifar_types_s1": {"fixed": (0.484, 13), "gap": (1.0, 5), "silhouette": (0.924, 6), "guarded": (1.0, 5)},
    "mnist_iid_s0": {"fixed": (0.0, 15), "gap": (0.0, 3), "silhouette": (0.0, 4), "guarded": (1.0, 1)},
    "mnist_iid_s1": {"fixed": (0.0, 20), "gap": (0.0, 2), "silhouette": (0.0, 8), "guarded": (1.0, 1)},
    "har_natural_s0": {"fixed": (0.0, 3), "gap": (0.0, 3), "silhouette": (0.0, 2), "guarded": (1.0, 1)},
    "har_natural_s1": {"fixed": (0.0, 2), "gap": (0.0, 2), "silhouette": (0.0, 2), "guarded": (1.0, 1)},
}
# The guarded cut's mean silhouette (step 2 of the rule) per case: the margins either side of 0.65.
SILHOUETTES = {"mnist_types_s0": 0.867, "mnist_types_s1": 0.954, "mnist_flip_s0": 0.705, "mnist_flip_s1": 0.718,
               "cifar_types_s0": 0.815, "cifar_types_s1": 0.825, "mnist_iid_s0": 0.574, "mnist_iid_s1": 0.418,
               "har_natural_s0": 0.090, "har_natural_s1": 0.004}


def _recompute(path: Path) -> dict[str, tuple[float, int]]:
    d = json.loads(path.read_text())
    truth = [int(t) for t in d["truth"]]
    p = list(d["kl"].values())[-1]
    out: dict[str, tuple[float, int]] = {}
    for rule in ("fixed", "gap", "silhouette", "guarded"):
        comps = distfl.link_components(p, distfl.choose_threshold(p, rule, 0.2))
        labels = [0] * len(p)
        for k, comp in enumerate(comps):
            for i in comp:
                labels[i] = k
        out[rule] = (round(distfl.adjusted_rand_index(truth, labels), 3), len(comps))
    return out


def test_the_committed_table_recomputes_from_the_dumped_matrices() -> None:
    paths = sorted(RESULTS.glob("*.json"))
    assert {p.stem for p in paths} == set(TABLE), "docs/results/distfl_default/ and TABLE disagree"
    for path in paths:
        got = _recompute(path)
        for rule, (ari, k) in TABLE[path.stem].items():
            assert got[rule][1] == k, (path.stem, rule, got[rule])
            assert math.isclose(got[rule][0], ari, abs_tol=1e-9), (path.stem, rule, got[rule])


def test_the_tool_prints_the_same_table() -> None:
    from tools.experiments import distfl_clustering as dc

    paths = sorted(RESULTS.glob("*.json"))
    lines = dc.rule_table([str(p) for p in paths])
    assert len(lines) == 2 + len(paths)
    for path, line in zip(paths, lines[2:], strict=True):
        for rule in ("fixed", "gap", "silhouette", "guarded"):
            ari, k = TABLE[path.stem][rule]
            assert f"{ari:.3f} / {k}" in line, (path.stem, rule, line)


def test_guarded_finds_types_whole_and_keeps_unstructured_fleets_whole() -> None:
    for stem, rules in TABLE.items():
        ari, k = rules["guarded"]
        assert ari == 1.0, (stem, rules["guarded"])
        if stem.startswith(("mnist_iid", "har_natural")):
            assert k == 1, stem


def test_the_guarded_cuts_silhouette_margins() -> None:
    for path in sorted(RESULTS.glob("*.json")):
        p = list(json.loads(path.read_text())["kl"].values())[-1]
        weighed = guarded_cut(p, min_silhouette=-1.0)
        assert weighed is not None
        assert round(weighed[2], 3) == SILHOUETTES[path.stem], (path.stem, weighed)
        assert (weighed[2] >= distfl.GUARD_SILHOUETTE) == (TABLE[path.stem]["guarded"][1] > 1)
