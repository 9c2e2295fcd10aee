"""HYDRA-FL acceptance experiment (issue 14): KD objectives with and without model poisoning, as real federations.

    python tools/experiments/kd_experiment.py run --scenario ntd [--arms fedavg fedntd hydra] [--rounds 20] [--epochs 2]
    python tools/experiments/kd_experiment.py run --scenario moon [--arms moon hydra_moon]
    python tools/experiments/kd_experiment.py run --scenario ntd --dev-type unit --tag g1 --attack-set gamma_init=1.0
    # an attack setting as a variant: the attacked runs are named dyn_opt_unit_g1
    python tools/experiments/kd_experiment.py run --scenario rules    # the attacks against trimmed mean / median / Krum
    python tools/experiments/kd_experiment.py summarize runs/kd_exp --md docs/results/hydra_acceptance.md
    python tools/experiments/kd_experiment.py summarize docs/results/hydra_acceptance --only ntd-  # from the kept
    # round files

``run`` launches, per arm and attack setting, one federation with ``fedguard-launch --config <scenario config>``
(a real fedserver and virtual fedclient processes on loopback, plaintext because the attack arms use the
full-knowledge test harness) in ``OUT/<scenario>-<arm>-<attack>-s<seed>/``:

- ``ntd`` (``configs/hydra_mnist_ntd.toml``, HYDRA-FL Table 1): 100 clients, 10 per round, Dirichlet(0.1) MNIST,
  trimmed mean; arms ``fedavg`` (vanilla), ``fedntd`` (τ = 1, β = 1), ``hydra`` (FedNTD base, b = 1, γ = 2, the
  trainer's default shallow head: after the second conv block, as the authors' code); the attack is Dyn-Opt from
  20% of the clients.
- ``moon`` (``configs/hydra_mnist_moon.toml``, HYDRA-FL Table 2): 10 clients, all per round; arms ``fedavg``,
  ``moon`` (μ = 1), ``hydra_moon`` (MOON base); the attack is Stat-Opt from 20% of the clients.
- ``rules``: FedAvg on the ntd setting with the small ``mnist_cnn`` under no attack, Stat-Opt and Dyn-Opt against
  trimmed mean (m = 2), median and Krum (f = 2), the defender's parameters fixed (no oracle trim); against the
  trimmed mean also with partial knowledge (``*_partial``: the attackers estimate the benign statistics from
  honest updates on 4 shards of their own data and assume a trimmed mean with m = 2).

A run stopped at ``--timeout`` keeps its completed rounds and resumes from them when the command is run again.
``summarize`` prints per run the global model's accuracy on the pooled test splits (``central``), at the last
round and averaged over the last 5 rounds, the accuracy drop under attack, and the harness's crafted rows. Its
directory holds run directories (``<run>/rounds.jsonl``) or kept round files (``<run>.rounds.jsonl``, as in
``docs/results/hydra_acceptance/``); ``--only`` keeps the runs whose name contains one of its strings. Where a seed
has all six runs of FedAvg, the KD arm and HYDRA-FL with and without an attack, it also prints HYDRA-FL's T1
directions in points: amplification (the KD arm's drop minus FedAvg's; the paper's is positive), recovery (HYDRA-FL
minus the KD arm under attack; positive) and clean cost (HYDRA-FL minus the KD arm without attack; about zero).
For every attacked run it prints the attack's damage per attacker in its round and its carry-over into the next
round (:func:`attack_damage`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.runs import RunDirError, finished, finite_mean, fmt, launch_run, read_rows  # noqa: E402

CONFIGS = {"ntd": "configs/hydra_mnist_ntd.toml", "moon": "configs/hydra_mnist_moon.toml",
           "rules": "configs/hydra_mnist_ntd.toml"}
# Arm -> the server's announced trainer (recovery.method and options).
ARMS: dict[str, list[str]] = {
    "fedavg": ["recovery.method=\"vanilla\""],
    "fedntd": ["recovery.method=\"fedntd\"", "recovery.options={tau = 1.0, beta = 1.0}"],
    "hydra": ["recovery.method=\"hydra\"",
              "recovery.options={base = \"fedntd\", tau = 1.0, beta = 1.0, b = 1.0, gamma = 2.0}"],
    "moon": ["recovery.method=\"moon\"", "recovery.options={mu = 1.0, temperature = 0.5}"],
    "hydra_moon": ["recovery.method=\"hydra\"", "recovery.options={base = \"moon\", temperature = 0.5}"],
}
DEFAULT_ARMS = {"ntd": ["fedavg", "fedntd", "hydra"], "moon": ["fedavg", "moon", "hydra_moon"],
                "rules": ["fedavg"]}
# HYDRA-FL App. C.2: Dyn-Opt for FedNTD, Stat-Opt for MOON.
SCENARIO_ATTACK = {"ntd": "dyn_opt", "moon": "stat_opt"}
# The rules scenario: the small MNIST CNN (cheap on a CPU) and the configured defender (no oracle trim).
RULES_BASE = ["model.name=\"mnist_cnn\"", "simulation_harness.trim_to_attackers=false"]
# Each sets the rule with its whole options table (the config file's trimmed_mean options do not apply to another rule).
RULES = {"trimmed_mean": [*RULES_BASE, "aggregation.rule=\"trimmed_mean\"", "aggregation.options={trim_m = 2}"],
         "median": [*RULES_BASE, "aggregation.rule=\"median\"", "aggregation.options={}"],
         "krum": [*RULES_BASE, "aggregation.rule=\"krum\"", "aggregation.options={krum_f = 2}"]}
ATTACKERS = 0.2
# HYDRA-FL's MNIST figures (no attack, attack), Table 1 (FedNTD setting, Dyn-Opt) and Table 2 (MOON setting,
# Stat-Opt), beside ours in the summary.
# ``ntd-hydra_s2``: the hydra arm's runs with the head after the second conv block (issue 28), kept under that name.
PAPER = {"ntd-fedavg": (92.12, 74.48), "ntd-fedntd": (93.03, 58.09), "ntd-hydra": (92.69, 76.67),
         "ntd-hydra_s2": (92.69, 76.67),
         "moon-fedavg": (88.02, 77.55), "moon-moon": (91.13, 72.32), "moon-hydra_moon": (92.04, 76.65)}


def plan(scenario: str, arms: list[str], dev_type: str = "std", tag: str = "",
         attack_set: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """(run name, extra launcher arguments) of every run of ``scenario``. A Dyn-Opt direction other than the
    default ``std`` is part of the attacked runs' names (``dyn_opt_unit``), so both can sit in one directory.
    ``attack_set``: more attack options (``KEY=VALUE``) for the attacked runs, whose names then end in ``_<tag>``
    (``dyn_opt_unit_g1``); the no-attack runs are the same runs with or without them."""
    if attack_set and not tag:
        raise ValueError("--attack-set needs a --tag (the attacked runs are named <attack>_<tag>)")
    if tag and not re.fullmatch(r"[a-z0-9]+", tag):
        raise ValueError(f"--tag must be lower-case letters and digits, got {tag!r}")
    tagged = [a for item in attack_set or [] for a in ("--attack-set", item)]
    runs: list[tuple[str, list[str]]] = []
    if scenario == "rules":
        for rule, rule_set in RULES.items():
            # Partial knowledge (the attackers' own shards; they assume a trimmed mean) against the trimmed mean.
            partial = ("stat_opt_partial", "dyn_opt_partial") if rule == "trimmed_mean" else ()
            for attack in ("none", "stat_opt", "dyn_opt", *partial):
                extra = [a for s in [*ARMS["fedavg"], *rule_set] for a in ("--server-set", s)]
                runs.append((f"rules-{rule}-{_label(attack, dev_type, tag)}",
                             extra + _attack_args(attack, dev_type, tagged)))
        return runs
    for arm in arms:
        for attack in ("none", SCENARIO_ATTACK[scenario]):
            extra = [a for s in ARMS[arm] for a in ("--server-set", s)]
            runs.append((f"{scenario}-{arm}-{_label(attack, dev_type, tag)}",
                         extra + _attack_args(attack, dev_type, tagged)))
    return runs


def _label(attack: str, dev_type: str, tag: str = "") -> str:
    if attack == "none":
        return attack
    label = f"{attack}_{dev_type}" if attack.startswith("dyn_opt") and dev_type != "std" else attack
    return f"{label}_{tag}" if tag else label


def _attack_args(attack: str, dev_type: str = "std", tagged: list[str] | None = None) -> list[str]:
    if attack == "none":
        return []
    kind, partial, _ = attack.partition("_partial")
    extra = ["--attack-set", f"dev_type={dev_type}"] if kind == "dyn_opt" and dev_type != "std" else []
    return ["--attack", kind, "--attackers", str(ATTACKERS), "--knowledge", "partial" if partial else "full", *extra,
            *(tagged or [])]


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = args.arms or DEFAULT_ARMS[args.scenario]
    try:
        runs = plan(args.scenario, arms, args.dev_type, args.tag, args.attack_set)
    except ValueError as err:
        raise SystemExit(f"run: {err}") from None
    for seed in args.seeds:
        for name, extra in runs:
            if args.only and not any(o in name for o in args.only):
                continue
            run_dir = out / f"{name}-s{seed}"
            if finished(run_dir):
                print(f"{run_dir.name}: already finished", flush=True)
                continue
            cmd = [sys.executable, "-m", "fedlaunch", "--config", CONFIGS[args.scenario], "--run-dir",
                   str(run_dir), "--seed", str(seed), "--insecure", "--server-set", "rounds.sampling_timeout_s=3600.0",
                   *extra]
            if args.epochs:
                cmd += ["--server-set", f"training.local_epochs={args.epochs}"]
            cmd += [a for item in args.server_set for a in ("--server-set", item)]
            if args.rounds:
                cmd += ["--rounds", str(args.rounds)]
            launch_run(cmd, run_dir, args.timeout)
    return 0


ROUND_FILE = ".rounds.jsonl"


def _runs(root: Path, only: list[str] | None = None) -> list[tuple[str, Path, bool]]:
    """(name, rounds source, finished) of every run under ``root``, sorted by name: run directories (finished as
    :func:`tools.runs.finished` says) and kept round files ``<name>.rounds.jsonl`` (counted as finished: only
    completed runs' files are kept). ``only``: names containing one of these strings."""
    found: list[tuple[str, Path, bool]] = []
    for p in sorted(root.iterdir()):
        if p.is_dir():
            found.append((p.name, p, finished(p)))
        elif p.is_file() and p.name.endswith(ROUND_FILE):
            found.append((p.name.removesuffix(ROUND_FILE), p, True))
    found.sort(key=lambda t: t[0])
    return [t for t in found if not only or any(o in t[0] for o in only)]


def summarize(args: argparse.Namespace) -> int:
    root = Path(args.dir)
    lines = ["| run | rounds | central acc (last) | central acc (last 5) | attackers/round | crafted/round | "
             "Dyn-Opt gamma | s/round |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    accs: dict[str, float] = {}
    for name, source, done_run in _runs(root, args.only):
        rows = [r for r in read_rows(source) if r.get("outcome")]
        if not rows:
            continue
        central = [float(r.get("central_accuracy", float("nan"))) for r in rows]
        last5 = finite_mean(central[-5:])
        accs[name] = last5
        done = "" if done_run else " (stopped)"
        lines.append(
            f"| {name}{done} | {len(rows)} | {fmt(central[-1])} | {fmt(last5)} | "
            f"{fmt(finite_mean([float(r.get('attackers', 0)) for r in rows]), 1)} | "
            f"{fmt(finite_mean([r['metrics'].get('harness_crafted', float('nan')) for r in rows]), 1)} | "
            f"{fmt(finite_mean([r['metrics'].get('harness_gamma', float('nan')) for r in rows]), 2)} | "
            f"{fmt(finite_mean([float(r.get('seconds', float('nan'))) for r in rows]), 1)} |")
    drops = ["", "| arm | no attack (last 5) | attack (last 5) | drop | paper (MNIST, 200/30 rounds) |",
             "| --- | --- | --- | --- | --- |"]
    for name, acc in sorted(accs.items()):
        if "-none-" not in name:
            continue
        prefix, seed = name.split("-none-")
        for attacked, acc2 in sorted(accs.items()):
            if attacked.startswith(prefix + "-") and attacked.endswith("-" + seed) and attacked != name:
                paper = PAPER.get(prefix)
                cited = f"{paper[0]:.2f} -> {paper[1]:.2f}" if paper else "-"
                arm = f"{attacked.removesuffix('-' + seed)} ({seed})"
                drops.append(f"| {arm} | {fmt(acc)} | {fmt(acc2)} | {fmt(acc - acc2)} | {cited} |")
    text = "\n".join(lines + drops + directions(accs) + damage_table(root, args.only)) + "\n"
    print(text)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        Path(args.md).write_text(text)
    if args.plot:
        _plot(root, Path(args.plot), args.only)
        print(f"plot: {args.plot}")
    return 0


# HYDRA-FL's T1 triples per scenario: (FedAvg arm, KD arm, HYDRA-FL arm).
TRIPLES = {"ntd": ("fedavg", "fedntd", "hydra"), "moon": ("fedavg", "moon", "hydra_moon")}


def _paper_directions(scenario: str) -> str:
    """The paper's three figures in points (its Table 1 or 2, MNIST)."""
    base, kd, hydra = (PAPER[f"{scenario}-{arm}"] for arm in TRIPLES[scenario])
    return (f"{(kd[0] - kd[1]) - (base[0] - base[1]):+.1f} / {hydra[1] - kd[1]:+.1f} / "
            f"{hydra[0] - kd[0]:+.1f}")


def directions(accs: dict[str, float]) -> list[str]:
    """HYDRA-FL's T1 directions, per scenario, seed and attack setting where all six runs of a triple are present
    (last-5 central accuracy, in points): amplification = the KD arm's drop under attack minus FedAvg's (the paper:
    > 0), recovery = HYDRA-FL minus the KD arm under attack (> 0), clean cost = HYDRA-FL minus the KD arm without
    attack (about 0)."""
    out = ["", "| scenario (seed, attack) | FedAvg drop | KD drop | amplification | recovery | clean cost | "
               "paper (ampl. / rec. / clean) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    found = False
    for name in sorted(accs):
        # <scenario>-<arm>-none-s<seed>; a scenario's variant (moon30r, moon5e) is its letters' scenario
        m = re.fullmatch(r"(([a-z]+)[a-z0-9]*)-([a-z_0-9]+?)-none-(s\d+)", name)
        if not m or m.group(2) not in TRIPLES or m.group(3) != TRIPLES[m.group(2)][0]:
            continue
        scenario, kind, base, seed = m.group(1), m.group(2), m.group(3), m.group(4)
        _, kd, hydra = TRIPLES[kind]
        for attacked in sorted(accs):
            a = re.fullmatch(rf"{scenario}-{base}-(.+)-{seed}", attacked)
            if not a or a.group(1) == "none":
                continue
            attack = a.group(1)
            names = [f"{scenario}-{arm}-{label}-{seed}" for arm in (base, kd, hydra) for label in ("none", attack)]
            if not all(n in accs for n in names):
                continue
            b0, b1, k0, k1, h0, h1 = (100 * accs[n] for n in names)
            found = True
            out.append(f"| {scenario} ({seed}, {attack}) | {b0 - b1:.1f} | {k0 - k1:.1f} | "
                       f"{(k0 - k1) - (b0 - b1):+.1f} | {h1 - k1:+.1f} | {h0 - k0:+.1f} | "
                       f"{_paper_directions(kind)} |")
    return out if found else []


def attack_damage(rows: list[dict[str, object]]) -> tuple[int, tuple[float, float], tuple[float, float]]:
    """How much each attacker costs the global model, from an attacked run's rounds in the second half of the run
    (after the climb of the first rounds): (rounds used, damage, carry-over), each as (points of central accuracy
    lost per attacker, standard error). One least-squares fit of a round's change in central accuracy on the number
    of attackers selected in that round and in the round before: damage is minus the first slope, carry-over minus
    the second. Damage that the following round amplifies (HYDRA-FL's account: benign clients distil from a
    poisoned global model) shows as a positive carry-over; a model that heals in the next round shows a negative
    one. The attackers per round are drawn by the selection seed, so every arm of a seed meets the same ones. NaN
    where the fit is not determined (fewer than 4 rounds, or counts that do not vary)."""
    import numpy as np

    acc = [100 * float(str(r.get("central_accuracy", "nan"))) for r in rows]
    att = [float(str(r.get("attackers", 0))) for r in rows]
    used = [i for i in range(max(1, len(rows) // 2), len(rows)) if not (math.isnan(acc[i]) or math.isnan(acc[i - 1]))]
    nan = (float("nan"), float("nan"))
    x = np.array([[1.0, att[i], att[i - 1]] for i in used]).reshape(-1, 3)
    y = np.array([acc[i] - acc[i - 1] for i in used])
    if len(used) < 4 or np.linalg.matrix_rank(x) < 3:
        return len(used), nan, nan
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    residual = y - x @ coef
    cov = float(residual @ residual) / (len(used) - 3) * np.linalg.inv(x.T @ x)
    return (len(used), (-float(coef[1]), math.sqrt(float(cov[1, 1]))),
            (-float(coef[2]), math.sqrt(float(cov[2, 2]))))


def damage_table(root: Path, only: list[str] | None = None) -> list[str]:
    """:func:`attack_damage` for every attacked run with rounds under ``root``; empty when there is none."""
    out = ["", "| attacked run | rounds used | attackers/round | damage (points per attacker) | "
               "carry-over (points per attacker) |", "| --- | --- | --- | --- | --- |"]
    for name, source, _ in _runs(root, only):
        rows = [r for r in read_rows(source) if r.get("outcome")]
        if "-none-" in name or not any(float(r.get("attackers", 0)) for r in rows):
            continue
        used, damage, carry = attack_damage(rows)
        att = finite_mean([float(r.get("attackers", 0)) for r in rows[max(1, len(rows) // 2):]])
        out.append(f"| {name} | {used} | {fmt(att, 2)} | {_pm(damage)} | {_pm(carry)} |")
    return out if len(out) > 3 else []


def _pm(v: tuple[float, float]) -> str:
    return "-" if math.isnan(v[0]) else f"{v[0]:+.2f} ± {v[1]:.2f}"


def _plot(root: Path, out: Path, only: list[str] | None = None) -> None:
    """Central accuracy per round, one panel per scenario and seed; an arm's attacked runs dashed in its colour."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'fedguard[plot]'") from None
    panels: dict[str, list[tuple[str, list[float]]]] = {}
    for name, source, _ in _runs(root, only):
        rows = [r for r in read_rows(source) if r.get("outcome")]
        if not rows:
            continue
        scenario, _, rest = name.partition("-")
        label, _, seed = rest.rpartition("-")
        panels.setdefault(f"{scenario} {seed}", []).append(
            (label, [float(r.get("central_accuracy", float("nan"))) for r in rows]))
    if not panels:
        raise SystemExit(f"--plot: no runs with rounds under {root}")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (title, curves) in zip(axes[0], sorted(panels.items()), strict=True):
        colours: dict[str, str] = {}
        for label, accs in curves:
            arm = label.rsplit("-", 1)[0]
            attacked = not label.endswith("-none")
            colour = colours.setdefault(arm, f"C{len(colours)}")
            ax.plot(range(1, len(accs) + 1), accs, color=colour, linestyle="--" if attacked else "-",
                    linewidth=1.2, label=label)
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.set_ylabel("central accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--scenario", choices=sorted(CONFIGS), required=True)
    r.add_argument("--out", default="runs/kd_exp")
    r.add_argument("--seeds", type=int, nargs="+", default=[0])
    r.add_argument("--arms", nargs="+", choices=sorted(ARMS))
    r.add_argument("--only", nargs="+", help="run only the runs whose name contains one of these")
    r.add_argument("--rounds", type=int, help="rounds per run (default: the config's)")
    r.add_argument("--epochs", type=int, help="local epochs (default: the config's)")
    r.add_argument("--dev-type", choices=["std", "sign", "unit"], default="std",
                   help="Dyn-Opt's direction (attack.dev_type; std is SPEC's default, unit the reference code's)")
    r.add_argument("--tag", default="", help="suffix of the attacked runs' names when --attack-set is given")
    r.add_argument("--attack-set", action="append", default=[], metavar="KEY=VALUE",
                   help="another attack option for the attacked runs (e.g. gamma_init=1.0; repeatable; needs --tag)")
    r.add_argument("--timeout", type=float, default=0.0, help="seconds per run (0: none)")
    r.add_argument("--server-set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="another server setting for every run (e.g. training.learning_rate=0.05)")
    s = sub.add_parser("summarize")
    s.add_argument("dir")
    s.add_argument("--md", help="also write the tables to this Markdown file")
    s.add_argument("--plot", help="also draw central accuracy per round to this PNG (needs matplotlib)")
    s.add_argument("--only", nargs="+", help="summarize only the runs whose name contains one of these")
    args = ap.parse_args(argv)
    try:
        return run(args) if args.cmd == "run" else summarize(args)
    except RunDirError as err:  # a run directory this runner did not write: nothing was touched
        print(f"{Path(__file__).name}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
