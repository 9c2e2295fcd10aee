"""DistFL clustering quality and cost, offline: the paper's open questions as numbers (issue 12, SPEC §8).

    python tools/experiments/distfl_clustering.py --dataset cifar10 --clients 20 --types 5 --samples 800 \\
        --z 50 100 200 --steps 0 50 200 --top 0.2 0.5 1.0 --md docs/results/distfl_clustering.md
    python tools/experiments/distfl_clustering.py --dataset mnist --scenario label-flip --clients 50 --attackers 20
    python tools/experiments/distfl_clustering.py --table docs/results/distfl_default/*.json   # no training (issue 49)

One DistFL clustering round, reproduced in-process with the same code the coordinator runs
(:mod:`fedcore.distfl`): ``--warmup`` rounds of FedAvg with every client (full participation, as in the paper),
then every client trains ``--epochs`` local epochs from the global model (its upload); M_target = the
sample-weighted mean of the uploads; for every (z, steps, E%) of the grid: extract the probe from M_target
(Eq. 4; ``steps = 0`` is the paper's "plain noise inputs" baseline of Fig. 6), every upload's softmax responses,
the KL matrix and the union-find clusters at each τ of ``--tau`` and at the τ of each automatic rule of ``--auto``
(``gap``, ``silhouette``, ``guarded``: :func:`fedcore.distfl.choose_threshold`). Printed per configuration: the
adjusted Rand index of the clusters against the true groups, the number of clusters (and purity: no cluster mixes
groups), the wall seconds of extraction, responses and clustering, and the separation diagnostic of the link distance
d = min(KL(V_i‖V_j), KL(V_j‖V_i)): the largest single-linkage merge height needed to join each true group
("within") against the smallest d between two groups ("across"); within < across means some τ recovers the groups
exactly (a threshold problem), within >= across that no τ can (a probe/feature problem). ``--dump`` writes the KL
matrices and the true groups as JSON.

Scenarios:
- ``types`` (DistFL Table 2, category imbalance): ``--types`` distribution types of disjoint class pairs, N/T
  clients each (``partition = "types"``), ``--samples`` training samples per client; true group = the type.
- ``label-flip`` (DistFL Table 5): IID clients, the first ``--attackers`` of them (a seeded draw) swap labels
  0–3 ↔ 4–7; true group = attacker or benign; also printed: whether every cluster is pure (no cluster mixes
  attackers and benign clients).
- ``iid`` and ``natural`` (issue 49): the dataset's IID partition, or its natural clients (HAR's volunteers, with
  ``--model har_cnn``), with no known groups: the true group is one for all, so ARI = 1 for one cluster and 0 for
  any split. ``--max-samples`` draws that many samples of the pool first (seeded), for speed.

``--table DUMP...`` trains nothing: it prints, per dump (one case and seed), the ARI and number of clusters of
every threshold rule (``fixed`` at τ = the single ``--tau`` given, else 0.2; ``gap``; ``silhouette``;
``guarded``) on the same matrix (``--matrix``, default the dump's last), with the run's wall seconds when the
dump records them: the issue-49 comparison, recomputable without training.

The model is any zoo model with BatchNorm (default ``mnist_cnn_bn``, given ``in_channels``/``image_size`` for
CIFAR-10: a small BN CNN that trains on 2 CPU cores). Every draw is seeded (model init, batches, extraction).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedcore import distfl  # noqa: E402
from fedcore.attacks import AttackConfig, LabelFlipOptions  # noqa: E402
from fedcore.attacks.poisoning import flip_labels  # noqa: E402
from fedcore.config import TrainingConfig  # noqa: E402
from fedcore.data import load_client_data  # noqa: E402
from fedcore.data.partition import client_types  # noqa: E402
from fedcore.models import build_model  # noqa: E402
from fedcore.seeds import derive_seed  # noqa: E402
from fedcore.train import train_local  # noqa: E402

FLIP = AttackConfig(kind="label_flip", options=LabelFlipOptions(flip="swap", pairs=((0, 4), (1, 5), (2, 6), (3, 7))))


def _weighted_mean(states: list[dict[str, torch.Tensor]], weights: list[float],
                   like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FedAvg of state dicts: floating tensors averaged by weight, the others (BN counters) from ``like``."""
    total = math.fsum(weights)
    out = dict(like)
    for k, v in like.items():
        if v.is_floating_point():
            acc = torch.zeros_like(v, dtype=torch.float64)
            for s, w in zip(states, weights, strict=True):
                acc += s[k].to(torch.float64) * (w / total)
            out[k] = acc.to(v.dtype)
    return out


def _data(args: argparse.Namespace) -> tuple[list[Any], list[int]]:
    """Every client's data and its true group."""
    base: dict[str, Any] = {"num_clients": args.clients}
    if args.scenario != "natural":
        base["pool"] = "train"
    if args.data_dir:
        base["data_dir"] = args.data_dir
    if args.max_samples:
        base["max_samples"] = args.max_samples
    if args.scenario == "types":
        opts = {**base, "partition": "types", "num_types": args.types, "samples_per_client": args.samples}
        data = [load_client_data(args.dataset, i, args.seed, opts) for i in range(args.clients)]
        return data, [int(t) for t in client_types(args.clients, args.types)]
    if args.scenario in ("iid", "natural"):  # no known groups: the truth is one group
        opts = {**base, "partition": args.scenario}
        return [load_client_data(args.dataset, i, args.seed, opts) for i in range(args.clients)], [0] * args.clients
    opts = {**base, "partition": "iid"}
    data = [load_client_data(args.dataset, i, args.seed, opts) for i in range(args.clients)]
    g = torch.Generator().manual_seed(derive_seed(args.seed, "distfl_clustering_attackers"))
    attackers = set(torch.randperm(args.clients, generator=g)[: args.attackers].tolist())
    groups = []
    for i, d in enumerate(data):
        if i in attackers:
            d.y_train = flip_labels(d.y_train, FLIP, d.num_classes)
        groups.append(1 if i in attackers else 0)
    return data, groups


def _uploads(args: argparse.Namespace, data: list[Any]) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]],
                                                                  dict[str, torch.Tensor], float]:
    kwargs: dict[str, Any] = {"num_classes": data[0].num_classes}
    if args.dataset == "cifar10" and args.model == "mnist_cnn_bn":
        kwargs |= {"in_channels": 3, "image_size": 32}
    model = build_model(args.model, kwargs, seed=args.seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    tc = TrainingConfig(local_epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr)
    weights = [float(d.num_train) for d in data]
    started = time.perf_counter()
    uploads: list[dict[str, torch.Tensor]] = []
    for r in range(1, args.warmup + 2):  # warm-up rounds, then the round whose uploads are clustered
        uploads = []
        for i, d in enumerate(data):
            model.load_state_dict(global_state)
            train_local(model, d.x_train, d.y_train, tc, seed=derive_seed(args.seed, i, r, "batches"))
            uploads.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        if r <= args.warmup:
            global_state = _weighted_mean(uploads, weights, global_state)
    target = _weighted_mean(uploads, weights, global_state)
    return model, uploads, target, time.perf_counter() - started


def separation(p: list[list[float]], truth: list[int]) -> tuple[float, float]:
    """(within, across): the largest single-linkage merge height inside any true group, and the smallest link
    distance between two groups (both on d = min(p, pᵀ)); within < across <=> some τ gives the groups exactly."""
    within = 0.0
    for g in sorted(set(truth)):
        idx = [i for i, t in enumerate(truth) if t == g]
        heights = distfl.single_link_merges([[p[i][j] for j in idx] for i in idx])
        within = max([within, *heights])
    across = min((min(p[i][j], p[j][i]) for i in range(len(p)) for j in range(len(p)) if truth[i] != truth[j]),
                 default=math.inf)
    return within, across


def _cell(p: list[list[float]], truth: list[int], tau: float, show_tau: bool) -> str:
    comps = distfl.link_components(p, tau)
    labels = [0] * len(p)
    for ci, comp in enumerate(comps):
        for i in comp:
            labels[i] = ci
    ari = distfl.adjusted_rand_index(truth, labels)
    pure = all(len({truth[i] for i in comp}) == 1 for comp in comps)
    return (f"{ari:.3f} / {len(comps)}" + (" pure" if pure else " mixed")
            + (f" (tau {tau:.3g})" if show_tau else ""))


RULES = ("fixed", "gap", "silhouette", "guarded")


def _significant(x: float, digits: int) -> float:
    return float(f"{x:.{digits}g}")


def rule_results(p: list[list[float]], truth: list[int], tau: float = 0.2,
                 rules: tuple[str, ...] = RULES) -> dict[str, dict[str, Any]]:
    """For each threshold rule on one KL matrix: the τ it chooses, the number of clusters, the ARI against
    ``truth``, whether every cluster is pure (no cluster mixes two true groups) and the largest cluster's size."""
    out: dict[str, dict[str, Any]] = {}
    for rule in rules:
        t = distfl.choose_threshold(p, rule, tau)
        comps = distfl.link_components(p, t)
        labels = [0] * len(p)
        for ci, comp in enumerate(comps):
            for i in comp:
                labels[i] = ci
        out[rule] = {"tau": t, "clusters": len(comps), "ari": distfl.adjusted_rand_index(truth, labels),
                     "pure": all(len({truth[i] for i in comp}) == 1 for comp in comps),
                     "largest": max(len(c) for c in comps)}
    return out


def dump_matrix(dump: dict[str, Any], key: str = "") -> tuple[str, list[list[float]]]:
    """The KL matrix ``key`` of a ``--dump`` file (default: the last one, the largest probe step count)."""
    kl: dict[str, list[list[float]]] = dump["kl"]
    key = key or list(kl)[-1]
    return key, kl[key]


def rule_table(paths: list[str], tau: float = 0.2, key: str = "") -> list[str]:
    """The issue-49 comparison: one markdown row per dump (case, seed), ARI / clusters of every rule of
    :data:`RULES` on that dump's one matrix, then the τ of the automatic rules and the run's wall seconds."""
    lines = ["| case | seed | clients | groups | matrix | within / across | "
             + " | ".join(f"{r}: ARI / clusters" for r in RULES) + " | tau gap / silhouette / guarded | "
             "training s | probe + responses s |",
             "|" + " --- |" * (9 + len(RULES))]
    for path in paths:
        dump = json.loads(Path(path).read_text())
        truth = [int(t) for t in dump["truth"]]
        mkey, p = dump_matrix(dump, key)
        res = rule_results(p, truth, tau)
        within, across = separation(p, truth)
        a = dump["args"]
        case = dump.get("case") or f"{a['dataset']} {a['scenario']}"
        cells = [f"{res[r]['ari']:.3f} / {res[r]['clusters']}" + ("" if res[r]["pure"] else " mixed")
                 for r in RULES]
        taus = " / ".join(f"{res[r]['tau']:.3g}" for r in RULES if r != "fixed")
        train = dump.get("train_s", "-")
        probe = dump.get("probe_s", {}).get(mkey, "-") if isinstance(dump.get("probe_s"), dict) else "-"
        sep = f"{within:.3g} / {across:.3g}" if math.isfinite(across) else f"{within:.3g} / -"
        lines.append(f"| {case} | {a['seed']} | {len(truth)} | {len(set(truth))} | {mkey} | {sep} | "
                     + " | ".join(cells) + f" | {taus} | {train} | {probe} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="cifar10")
    ap.add_argument("--data-dir", default="", help="where the dataset files are (default: the loader's search)")
    ap.add_argument("--scenario", choices=["types", "label-flip", "iid", "natural"], default="types")
    ap.add_argument("--max-samples", type=int, default=0,
                    help="draw this many samples of the pool (seeded) before partitioning (0: all)")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--types", type=int, default=5)
    ap.add_argument("--samples", type=int, default=800, help="training samples per client (types)")
    ap.add_argument("--attackers", type=int, default=20, help="label-flip: attacking clients")
    ap.add_argument("--model", default="mnist_cnn_bn")
    ap.add_argument("--warmup", type=int, default=2, help="FedAvg rounds before the clustered round")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--z", type=int, nargs="+", default=[200])
    ap.add_argument("--steps", type=int, nargs="+", default=[0, 200])
    ap.add_argument("--top", type=float, nargs="+", default=[0.5])
    ap.add_argument("--tau", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5])
    ap.add_argument("--auto", nargs="*", default=["gap", "silhouette"], choices=[t for t in distfl.THRESHOLDS
                                                                            if t != "fixed"],
                    help="automatic thresholds to evaluate beside the fixed ones")
    ap.add_argument("--dump", default="", help="write the KL matrices and the true groups to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--md", default="", help="also write the table to this markdown file")
    ap.add_argument("--case", default="", help="the case's name, stored in the dump (default: dataset scenario)")
    ap.add_argument("--dump-digits", type=int, default=0,
                    help="round the dumped KL values to this many significant digits (0: full precision)")
    ap.add_argument("--table", nargs="+", default=[], metavar="DUMP",
                    help="no training: print the fixed / gap / silhouette / guarded comparison of these dumps "
                         "(one matrix each: --matrix, default the last) and exit")
    ap.add_argument("--matrix", default="", help="with --table: the matrix key of each dump")
    args = ap.parse_args(argv)
    if args.table:
        lines = rule_table(args.table, args.tau[0] if len(args.tau) == 1 else 0.2, args.matrix)
        print("\n".join(lines))
        if args.md:
            Path(args.md).write_text("\n".join(lines) + "\n")
        return 0
    torch.set_num_threads(1)

    data, truth = _data(args)
    model, uploads, target, train_s = _uploads(args, data)
    input_shape = tuple(model.input_shape)  # type: ignore[arg-type]
    lines = [f"# DistFL clustering, {args.scenario} on {args.dataset}: {args.clients} clients, model {args.model}, "
             f"{args.warmup} warm-up FedAvg rounds + 1 clustered round, {args.epochs} local epoch(s), seed "
             f"{args.seed} (training {train_s:.1f} s)", "",
             "| z | steps | E% | Eq. 4 loss (first -> final) | extract s | responses s | cluster s | "
             "within / across | "
             + " | ".join([f"ARI / clusters at tau={t}" for t in args.tau]
                          + [f"ARI / clusters, {a}" for a in args.auto])
             + " |",
             "|" + " --- |" * (8 + len(args.tau) + len(args.auto))]
    dump: dict[str, Any] = {"args": vars(args), "case": args.case or f"{args.dataset} {args.scenario}",
                            "truth": truth, "kl": {}, "train_s": round(train_s, 1), "probe_s": {}}
    print("\n".join(lines), flush=True)
    for z, steps, top in itertools.product(args.z, args.steps, args.top):
        cfg = distfl.DistflConfig(enabled=True, z=z, steps=steps, top_fraction=top).validate()
        model.load_state_dict(target)
        t0 = time.perf_counter()
        ext = distfl.synthesize(model, input_shape, cfg,
                                torch.Generator().manual_seed(derive_seed(args.seed, "distfl_inputs")))
        t1 = time.perf_counter()
        vs = []
        for up in uploads:
            model.load_state_dict(up)
            vs.append(distfl.responses(model, ext.inputs))
        t2 = time.perf_counter()
        p = distfl.kl_matrix(vs).tolist()
        dump["kl"][f"z{z}_steps{steps}_top{top}"] = (
            [[_significant(a, args.dump_digits) for a in row] for row in p] if args.dump_digits > 0 else p)
        dump["probe_s"][f"z{z}_steps{steps}_top{top}"] = round(t2 - t0, 1)
        cells = [_cell(p, truth, tau, False) for tau in args.tau]
        t3 = time.perf_counter()
        cells += [_cell(p, truth, distfl.choose_threshold(p, a, cfg.tau), True) for a in args.auto]
        within, across = separation(p, truth)
        first = f"{float(ext.losses[0]):.3f}" if len(ext.losses) else "-"
        row = (f"| {z} | {steps} | {round(top * 100)} | {first} -> {float(ext.final_loss):.3f} | "
               f"{t1 - t0:.2f} | {t2 - t1:.2f} | {(t3 - t2) / max(1, len(args.tau)):.3f} | "
               f"{within:.3g} / {across:.3g} | "
               + " | ".join(cells) + " |")
        lines.append(row)
        print(row, flush=True)
    if args.dump:
        Path(args.dump).parent.mkdir(parents=True, exist_ok=True)
        Path(args.dump).write_text(json.dumps(dump))
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
