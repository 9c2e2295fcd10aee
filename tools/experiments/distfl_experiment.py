"""DistFL acceptance experiment (issue 12): DistFL vs FedAvg vs Local as real federations on loopback.

    python tools/experiments/distfl_experiment.py run --scenario mnist-flip --seeds 0 [--rounds 30] [--timeout 540] \
        [--arms distfl distfl-gap fedavg]
    python tools/experiments/distfl_experiment.py summarize runs/distfl_exp --md docs/results/distfl_acceptance.md

``run`` launches, per scenario and seed, two federations with ``fedguard-launch --config
configs/distfl_<scenario>.toml`` (real fedserver and virtual fedclient processes): ``distfl`` (the config's
``[distfl]``) and ``fedavg`` (``distfl.enabled = false``), each in ``OUT/<scenario>-<arm>-s<seed>/``; ``--arms``
also offers ``distfl-gap`` and ``distfl-silhouette`` (the config's ``[distfl]`` with the automatic threshold
``distfl.threshold = "gap"`` / ``"silhouette"``, issue 28) and ``distfl-fixed`` (``distfl.threshold = "fixed"``). A run
stopped at ``--timeout`` keeps its completed rounds and resumes from them when the command is run again.

``summarize`` reads the runs and prints, per scenario and arm, means of the last 10 rounds (every client takes
part in every round in these scenarios):
- ``local acc``: the clients' accuracy on their own test splits with the model they were handed (DistFL: their
  cluster's; FedAvg: the global model), benign clients only;
- ``Local``: the clients' stand-alone models' accuracy Pᵢ = Vᵢ − βᵢ (benign), the "Local" row of DistFL Table 2;
- ``ARI`` and ``purity``: the final clusters against the true groups (types: the distribution type; mnist-flip:
  attacker or benign; har: none, the number of clusters only) and the number of clusters;
- mnist-flip: accuracy and attack success rate (DistFL Eq. 9, sources 0–7 → their swapped labels) of the model
  of the cluster holding most benign clients, and of FedAvg's global model, on the pooled test splits.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.runs import RunDirError, finished, finite_mean, fmt, launch_run, read_rows  # noqa: E402

SCENARIOS = {"cifar-types": "configs/distfl_cifar_types.toml",
             "cifar-types-small": "configs/distfl_cifar_types_small.toml",
             "mnist-types": "configs/distfl_mnist_types.toml", "mnist-flip": "configs/distfl_mnist_flip.toml",
             "har": "configs/distfl_har.toml"}
ARMS = {"distfl": [], "distfl-fixed": ["--server-set", "distfl.threshold=fixed"],
        "distfl-gap": ["--server-set", "distfl.threshold=gap"],
        "distfl-silhouette": ["--server-set", "distfl.threshold=silhouette"],
        "fedavg": ["--server-set", "distfl.enabled=false"]}


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for arm in args.arms:
            extra = ARMS[arm]
            name = f"{args.scenario}-{arm}-s{seed}"
            run_dir = out / name
            if finished(run_dir):
                print(f"{name}: already finished", flush=True)
                continue
            # Every client trains its private model (Local) before it asks for work: on a small machine the whole
            # fleet takes longer than the default 300 s to be ready.
            cmd = [sys.executable, "-m", "fedlaunch", "--config", SCENARIOS[args.scenario], "--run-dir",
                   str(run_dir), "--seed", str(seed), "--server-set", "rounds.sampling_timeout_s=3600.0", *extra]
            if args.rounds:
                cmd += ["--rounds", str(args.rounds)]
            launch_run(cmd, run_dir, args.timeout)
    return 0


def _final(run_dir: Path) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """The final snapshot's models by id and its DistFL slot."""
    from fedserver.store import StateStore

    store = StateStore(run_dir / "state", keep=3)
    try:
        snap = store.load().snapshot
        if snap is None:
            return {}, {}
        return {k: dict(v) for k, v in snap.models.items()}, dict(snap.state.get("slots", {}).get("distfl", {}))
    finally:
        store.close()


def _truth(scenario: str, config: dict[str, Any], seed: int, n: int) -> dict[str, int] | None:
    if config["data"]["options"].get("partition") == "types":
        from fedcore.data.partition import client_types

        types = client_types(n, int(config["data"]["options"]["num_types"]))
        return {f"client-{i:05d}": int(types[i]) for i in range(n)}
    if scenario == "mnist-flip":
        from fedlaunch.plan import attacker_indices

        bad = set(attacker_indices(n, float(config["launch"]["attackers"]), seed))
        return {f"client-{i:05d}": int(i in bad) for i in range(n)}
    return None


def _flip_metrics(config: dict[str, Any], seed: int, state: dict[str, Any]) -> tuple[float, float]:
    """Accuracy and ASR of ``state`` on the pooled test splits of the scenario's clients."""
    import torch

    from fedcore.attacks import AttackConfig, LabelFlipOptions
    from fedcore.attacks.poisoning import target_mapping
    from fedcore.data import load_client_data
    from fedcore.metrics import attack_success_rate, central_accuracy, pooled_test_set
    from fedcore.models import build_model

    opts = dict(config["data"]["options"])
    n = int(opts["num_clients"])
    x, y = pooled_test_set(load_client_data(config["data"]["dataset"], i, seed, opts) for i in range(n))
    model = build_model(config["model"]["name"], config["model"].get("kwargs", {}), seed=seed)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    attack = config["launch"]["attack"]
    table = attack.get("options", attack)  # the kind's options table (or the old flat keys)
    flip = LabelFlipOptions(flip=table["flip"], pairs=tuple((int(a), int(b)) for a, b in table["pairs"]))
    mapping = target_mapping(AttackConfig(kind="label_flip", options=flip), 10)
    return central_accuracy(model, x, y), attack_success_rate(model, x, y, mapping)


def purity(truth: dict[str, int], assignment: dict[str, str]) -> float:
    """Share of clients whose cluster's most common true group is their own (1.0: no cluster mixes groups,
    however many clusters a group is split into; ARI also penalises the splitting)."""
    members: dict[str, list[int]] = {}
    for cid, cluster in assignment.items():
        members.setdefault(cluster, []).append(truth[cid])
    return sum(max(g.count(v) for v in set(g)) for g in members.values()) / len(assignment)


def summarize(args: argparse.Namespace) -> int:
    import tomllib

    base = Path(args.dir)
    lines = ["| scenario | arm | seeds | rounds | local acc (benign) | Local (benign) | clusters | ARI | purity | "
             "benign-cluster / global ACC | ASR |", "|" + " --- |" * 11]
    for scenario, cfg_path in SCENARIOS.items():
        config = tomllib.loads((ROOT / cfg_path).read_text())
        n = int(config["launch"]["clients"])
        for arm in ARMS:
            all_names = sorted(p.name for p in base.glob(f"{scenario}-{arm}-s*") if read_rows(p))
            for names in ([[name] for name in all_names] if args.per_seed else [all_names] if all_names else []):
                lines.append(_summary_row(base, scenario, arm, config, n, names))
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


def _summary_row(base: Path, scenario: str, arm: str, config: dict[str, Any], n: int, names: list[str]) -> str:
    """One table row: the means over the runs ``names`` (one per seed) of ``scenario``/``arm``."""
    from fedcore.distfl import adjusted_rand_index

    acc, local, clusters, aris, purities, accs, asrs, reached = [], [], [], [], [], [], [], []
    for name in names:
        run_dir = base / name
        seed = int(name.rsplit("-s", 1)[1])
        rows = read_rows(run_dir)
        tail = rows[-10:]
        reached.append(str(len(rows)))
        acc.append(finite_mean([r.get("test_accuracy_benign", math.nan) for r in tail]))
        local.append(finite_mean([r.get("test_accuracy_benign", math.nan) - r.get("beta_benign", math.nan)
                                  for r in tail]))
        models, slot = _final(run_dir)
        assignment = dict(slot.get("state", {}).get("assignment", {}))
        clusters.append(float(len(set(assignment.values()))) if assignment else math.nan)
        truth = _truth(scenario, config, seed, n)
        if truth is not None and assignment:
            ids = sorted(assignment)
            aris.append(adjusted_rand_index([truth[c] for c in ids], [assignment[c] for c in ids]))
            purities.append(purity({c: truth[c] for c in ids}, assignment))
        if scenario == "mnist-flip" and models:
            if arm.startswith("distfl") and assignment and truth is not None:
                benign = [assignment[c] for c in assignment if truth[c] == 0]
                model_id = max(sorted(set(benign)), key=benign.count)
            else:
                model_id = "global"
            a, s = _flip_metrics(config, seed, models[model_id])
            accs.append(a)
            asrs.append(s)
    seeds = "/".join(name.rsplit("-s", 1)[1] for name in names)
    return (f"| {scenario} | {arm} | {seeds} | {'/'.join(reached)} | {fmt(finite_mean(acc))} | "
            f"{fmt(finite_mean(local))} | {fmt(finite_mean(clusters))} | {fmt(finite_mean(aris))} | "
            f"{fmt(finite_mean(purities))} | "
            f"{fmt(finite_mean(accs))} | {fmt(finite_mean(asrs))} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--scenario", choices=list(SCENARIOS), required=True)
    r.add_argument("--out", default="runs/distfl_exp")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--rounds", type=int, default=0, help="0: the config's")
    r.add_argument("--timeout", type=float, default=0.0, help="stop a run after this many seconds (0: never)")
    r.add_argument("--arms", nargs="+", choices=list(ARMS), default=["distfl", "fedavg"])
    s = sub.add_parser("summarize")
    s.add_argument("dir")
    s.add_argument("--md", default="")
    s.add_argument("--per-seed", action="store_true", help="one row per seed instead of the mean over seeds")
    args = ap.parse_args(argv)
    try:
        return run(args) if args.cmd == "run" else summarize(args)
    except RunDirError as err:  # a run directory this runner did not write: nothing was touched
        print(f"{Path(__file__).name}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
