"""DistFL: the paper's sequential threshold rule against SPEC §8's union-find, on dumped KL matrices (issue 28).

    python tools/experiments/distfl_rules.py runs/distfl_clustering/*.json

Reads the ``--dump`` files of ``tools/experiments/distfl_clustering.py`` (KL matrices and true groups) and prints, for
every
matrix, at the fixed τ = ``--tau`` and at the τ of the ``gap`` rule, the number of clusters and the ARI of

- the paper's rule (DistFL §4.3: "given an uploaded model, we set a threshold to pick out the similar models ... to
  form a rough iid cluster. For other unselected models, we follow the above step"): take the first unassigned
  model, its cluster is every unassigned model within τ of it (either KL direction), repeat;
- SPEC §8's rule (:func:`fedcore.distfl.link_components`): the connected components of the same links.

Also at the τ of the largest gap in *all* sorted pairwise link distances (``all-pairs-gap``, the first suggestion
of issue 28), to show why the ``gap`` rule cuts the single-linkage merge heights instead.

Every cluster of the paper's rule is linked to its first model, so it lies inside one union-find component: at
the same τ the union-find rule never gives more clusters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedcore import distfl  # noqa: E402


def sequential_labels(p: list[list[float]], tau: float) -> list[int]:
    """The paper's sequential threshold partition (module docstring), models taken in index order."""
    n = len(p)
    labels = [-1] * n
    cluster = 0
    for lead in range(n):
        if labels[lead] >= 0:
            continue
        for j in range(n):
            if labels[j] < 0 and (j == lead or min(p[lead][j], p[j][lead]) < tau):
                labels[j] = cluster
        cluster += 1
    return labels


def all_pairs_gap(p: list[list[float]]) -> float:
    """Midpoint of the largest gap between consecutive sorted link distances d(i, j) = min(p[i][j], p[j][i]) over
    all pairs i < j (ties: the lower pair)."""
    n = len(p)
    ds = sorted(min(p[i][j], p[j][i]) for i in range(n) for j in range(i + 1, n))
    if len(ds) < 2:
        raise ValueError("all_pairs_gap: needs at least three clients")
    k = max(range(len(ds) - 1), key=lambda a: (ds[a + 1] - ds[a], -a))
    return (ds[k] + ds[k + 1]) / 2


def component_labels(p: list[list[float]], tau: float) -> list[int]:
    labels = [0] * len(p)
    for k, comp in enumerate(distfl.link_components(p, tau)):
        for i in comp:
            labels[i] = k
    return labels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dumps", nargs="+")
    ap.add_argument("--tau", type=float, default=0.2, help="the fixed threshold to compare at")
    args = ap.parse_args(argv)
    print("| dump | matrix | threshold | tau | paper's rule: clusters / ARI | union-find: clusters / ARI |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in args.dumps:
        d = json.loads(Path(path).read_text())
        truth = [int(t) for t in d["truth"]]
        for key, p in d["kl"].items():
            for name in ("fixed", "gap", "all-pairs-gap"):
                tau = all_pairs_gap(p) if name == "all-pairs-gap" else distfl.choose_threshold(p, name, args.tau)
                seq, uf = sequential_labels(p, tau), component_labels(p, tau)
                print(f"| {Path(path).name} | {key} | {name} | {tau:.3g} | {len(set(seq))} / "
                      f"{distfl.adjusted_rand_index(truth, seq):.3f} | {len(set(uf))} / "
                      f"{distfl.adjusted_rand_index(truth, uf):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
