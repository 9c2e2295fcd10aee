"""Start-up guards for FL-GUARD's β̂ detector, compared offline on recorded federations (issue 28, item 3).

    python tools/experiments/nfl_guard.py docs/results/recovery_methods docs/results/nfl_paper docs/results/nfl_guard \\
        --into docs/results/nfl_guard.md

Each PATH is a campaign directory (or run directories / ``NAME.rounds.jsonl`` files, names
``[prefix-]<env>-<arm>-s<seed>`` as for ``tools/experiments/nfl_experiment.py``), read as one group. Of each group only
the FedAvg runs (arm ``fedavg``, every row recorded with ``nfl = off``) are replayed: their β̂ᵢ were all
measured on the global model, so the round medians are what *any* detector in mode detect-and-recover would have
observed up to its first report (after a report, recovery changes the model the clients measure β̂ᵢ with, so a
run with a report is exact only up to it). The replay feeds the recorded per-round observation -- ``(round,
beta_hat, metrics.delta)``, what ``fedserver/nfl_monitor.py`` gives the detector -- to :func:`fedcore.nfl.step`
with each candidate's configuration, so the figures are those of the detector code itself.

For each candidate (:data:`CANDIDATES`) and NR = c in :data:`NRS` it reports, per group and seed: the first report
round in the ideal environment (a false report), the closest the ideal run came to a report (the peak negative
count against the NR + 1 needed, or the CUSUM statistic against h), and the detection round in the NFL environment
with its delay against the paper's rule at the same NR; then a summary over all groups (the trade-off table).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fedcore import nfl  # noqa: E402
from fedcore.registry import options_as  # noqa: E402
from tools.experiments.nfl_experiment import BEGIN, END, RunData, load_runs, splice  # noqa: E402
from tools.runs import finite_mean, md_table, opt_text  # noqa: E402

NRS = (10, 20)


@dataclass(frozen=True)
class Candidate:
    label: str
    detector: str
    settings: dict[str, Any]
    uses_nr: bool = True  # False: the first report does not depend on NR (CUSUM)

    def config(self, nr: int) -> nfl.NflConfig:
        return nfl.NflConfig(detector=self.detector, nr=nr, c=nr, detector_options=self.settings).validate()


CANDIDATES = (
    Candidate("paper (beta_hat)", "beta_hat", {}),
    Candidate("warm-up W = 3", "beta_hat_warmup", {"warmup": 3}),
    Candidate("warm-up W = 5", "beta_hat_warmup", {"warmup": 5}),
    Candidate("warm-up W = 10", "beta_hat_warmup", {"warmup": 10}),
    Candidate("plateau k = 1", "beta_hat_plateau", {"plateau_rounds": 1}),
    Candidate("plateau k = 2", "beta_hat_plateau", {"plateau_rounds": 2}),
    Candidate("plateau k = 3", "beta_hat_plateau", {"plateau_rounds": 3}),
    Candidate("CUSUM k = 0.05, h = 1.5", "beta_hat_cusum", {"cusum_k": 0.05, "cusum_h": 1.5}, uses_nr=False),
    Candidate("CUSUM k = 0.05, h = 2", "beta_hat_cusum", {"cusum_k": 0.05, "cusum_h": 2.0}, uses_nr=False),
    Candidate("CUSUM k = 0.05, h = 3", "beta_hat_cusum", {"cusum_k": 0.05, "cusum_h": 3.0}, uses_nr=False),
)


def _number(v: Any) -> float | None:
    return None if v is None or not isinstance(v, (int, float)) or not math.isfinite(v) else float(v)


def observations(rows: list[dict[str, Any]]) -> list[nfl.NflObservation]:
    """What the server's NFL monitor fed the detector each round (``fedserver/nfl_monitor.py``)."""
    return [nfl.NflObservation(int(r["round"]), _number(r.get("beta_hat")), _number((r.get("metrics") or {}).get(
        "delta"))) for r in rows]


@dataclass(frozen=True)
class Replay:
    """A detector replayed over one run: its first report round (None: none in the run's rounds), the closest it
    came before that (``peak`` of ``threshold``: the negative count against NR + 1, or CUSUM's S against h), the
    round its start-up guard armed it, and the rounds replayed."""

    report: int | None
    peak: float
    threshold: float
    armed: int | None
    rounds: int


def replay(obs: list[nfl.NflObservation], config: nfl.NflConfig) -> Replay:
    """Step ``config``'s detector over ``obs`` until its first report."""
    s = nfl.init(config)
    cusum = config.detector == "beta_hat_cusum"
    h = options_as(config.detector_options, nfl.CusumOptions, "nfl.detector_options").cusum_h if cusum else 0.0
    peak = 0.0
    for o in obs:
        s, events = nfl.step(s, o, config)
        peak = max(peak, s.cusum if cusum else float(s.count))
        if any(e.kind == nfl.REPORTED for e in events):
            return Replay(o.round, peak, h if cusum else nfl.thresholds(config)[0] + 1, s.armed_round, len(obs))
    return Replay(None, peak, h if cusum else nfl.thresholds(config)[0] + 1, s.armed_round, len(obs))


def vanilla_runs(paths: list[str]) -> dict[tuple[str, str, int], RunData]:
    """The FedAvg runs (arm ``fedavg``) of ``paths``; :class:`SystemExit` if one has a row not recorded with
    ``nfl = off``."""
    runs = {k: rd for k, rd in load_runs(paths).items() if k[1] == "fedavg" and rd.rows}
    for rd in runs.values():
        if any(r.get("nfl") != "off" for r in rd.rows):
            raise SystemExit(f"nfl_guard: {rd.name} has rounds recorded with the detector on; replay needs nfl = off")
    return runs


def _peak(rp: Replay) -> str:
    return f"{rp.peak:.2f}/{rp.threshold:g}" if rp.threshold != int(rp.threshold) or rp.peak != int(rp.peak) \
        else f"{int(rp.peak)}/{int(rp.threshold)}"


# The ground truth of an NFL-environment run: its benign β (on the clients' full test splits) averaged over the
# rounds after the first START_UP (the start-up the guards are about); below 0 the run is in NFL.
START_UP = 10


def benign_beta(rd: RunData, after: int = START_UP) -> float:
    """Mean benign β over the rounds after ``after``."""
    return finite_mean([r.get("beta_benign", math.nan) for r in rd.rows if int(r["round"]) > after])


@dataclass(frozen=True)
class _Group:
    name: str
    ideal: dict[int, list[nfl.NflObservation]]
    nfl: dict[int, tuple[list[nfl.NflObservation], float, float]]  # seed -> (obs, β after START_UP, β last 10)


def _groups(groups: list[tuple[str, dict[tuple[str, str, int], RunData]]]) -> list[_Group]:
    out = []
    for name, runs in groups:
        out.append(_Group(name, {k[2]: observations(rd.rows) for k, rd in sorted(runs.items()) if k[0] == "ideal"},
                          {k[2]: (observations(rd.rows), benign_beta(rd),
                                  finite_mean([r.get("beta_benign", math.nan) for r in rd.rows[-10:]]))
                           for k, rd in sorted(runs.items()) if k[0] == "nfl"}))
    return out


def tables(groups: list[tuple[str, dict[tuple[str, str, int], RunData]]]) -> str:
    """The trade-off table (one row per candidate and NR), the per-group per-seed table, and the ground truth."""
    gs = _groups(groups)
    head = ["guard", "NR = c", "ideal: runs with a report", "ideal: closest approach", "NFL env, runs in NFL: "
            "reported", "delay vs paper rule, mean (max)", "NFL env, runs not in NFL: reported"]
    detail_head = ["group", "guard", "NR = c", "ideal: report round per seed", "ideal: peak per seed",
                   "ideal: armed at", "NFL env: report round (delay vs paper) per seed", "NFL env: armed at"]
    summary, detail = [], []
    for cand in CANDIDATES:
        for nr in (NRS if cand.uses_nr else NRS[:1]):
            cfg, paper_cfg = cand.config(nr), CANDIDATES[0].config(nr)
            guarded = cand.detector in ("beta_hat_warmup", "beta_hat_plateau")
            n_ideal = false = n_in = hit_in = n_out = hit_out = 0
            delays: list[int] = []
            worst, worst_text = -1.0, "-"
            for g in gs:
                ideal = {seed: replay(o, cfg) for seed, o in g.ideal.items()}
                n_ideal += len(ideal)
                false += sum(rp.report is not None for rp in ideal.values())
                for rp in ideal.values():
                    if rp.peak / rp.threshold > worst:
                        worst, worst_text = rp.peak / rp.threshold, _peak(rp)
                cells, armed = [], []
                for seed, (o, beta_after, _) in g.nfl.items():
                    mine, paper = replay(o, cfg), replay(o, paper_cfg)
                    armed.append(opt_text(mine.armed))
                    if beta_after < 0:
                        n_in += 1
                        hit_in += mine.report is not None
                        if mine.report is not None and paper.report is not None:
                            delays.append(mine.report - paper.report)
                    else:
                        n_out += 1
                        hit_out += mine.report is not None
                    d = "" if mine.report is None or paper.report is None else f" ({mine.report - paper.report:+d})"
                    cells.append(f"s{seed}: {opt_text(mine.report)}{d}")
                detail.append([
                    g.name, cand.label, str(nr) if cand.uses_nr else f"- (c = {nr})",
                    " / ".join(f"s{seed}: {opt_text(rp.report)}" for seed, rp in ideal.items()) or "-",
                    " / ".join(_peak(rp) for rp in ideal.values()) or "-",
                    " / ".join(opt_text(rp.armed) for rp in ideal.values()) if guarded else "-",
                    " / ".join(cells) or "-", " / ".join(armed) if guarded else "-"])
            summary.append([cand.label, str(nr) if cand.uses_nr else "-", f"{false}/{n_ideal}", worst_text,
                            f"{hit_in}/{n_in}",
                            "-" if not delays else f"{sum(delays) / len(delays):+.1f} ({max(delays):+d})",
                            f"{hit_out}/{n_out}"])
    truth_head = ["group", "seed", "rounds", f"benign beta after round {START_UP}", "benign beta, last 10",
                  "in NFL"]
    truth = [[g.name, str(seed), str(len(o)), f"{after:+.3f}", f"{last:+.3f}", "yes" if after < 0 else "no"]
             for g in gs for seed, (o, after, last) in g.nfl.items()]
    return "\n".join([*md_table(head, summary), "", *md_table(detail_head, detail), "", *md_table(truth_head, truth)])


# A live detect-and-recover run reports within this many rounds of the replay of the same seed's FedAvg run (issue
# 49): up to its report both runs train the same vanilla FedAvg, so only the clients' own early adaptation (which
# moves a few β̂ᵢ before the server reports) and thread timing can part them.
AGREEMENT_ROUNDS = 2


@dataclass(frozen=True)
class Agreement:
    """One seed of one environment: the live detect run's first report, the replay's, and whether they agree."""

    env: str
    seed: int
    nr: int
    c: int
    detector: str
    live: int | None
    replayed: int | None

    @property
    def agrees(self) -> bool:
        if self.live is None or self.replayed is None:
            return self.live is None and self.replayed is None
        return abs(self.live - self.replayed) <= AGREEMENT_ROUNDS


def live_config(rd: RunData) -> nfl.NflConfig:
    """The detector configuration a detect run ran with: its record's NR, c and detector (the server's default
    detector when the record names none)."""
    spec = (rd.record or {}).get("spec") or {}
    if "nr" not in spec or "c" not in spec:
        raise SystemExit(f"nfl_guard: {rd.name} has no record with its nr and c (collect it with its record)")
    return nfl.NflConfig(detector=str(spec.get("detector") or nfl.NflConfig().detector), nr=int(spec["nr"]),
                         c=int(spec["c"])).validate()


def agreement(runs: dict[tuple[str, str, int], RunData]) -> list[Agreement]:
    """For every detect run with a FedAvg run of the same (env, seed): the live report round against the replay of
    the FedAvg run's observations through the same detector configuration."""
    out = []
    for (env, arm, seed), rd in sorted(runs.items()):
        ref = runs.get((env, "fedavg", seed))
        if arm != "detect" or ref is None or not ref.rows or not rd.rows:
            continue
        cfg = live_config(rd)
        live = next((int(r["round"]) for r in rd.rows if r.get("nfl") == "reported"), None)
        if len(ref.rows) < (live or len(rd.rows)) + AGREEMENT_ROUNDS:
            continue  # the FedAvg run has not reached the rounds that decide the comparison yet
        out.append(Agreement(env, seed, int(cfg.nr or 0), int(cfg.c or 0), cfg.detector, live,
                             replay(observations(ref.rows), cfg).report))
    return out


def agreement_table(rows: list[Agreement]) -> str:
    head = ["env", "seed", "detector", "NR = c", "live report round", "replay of FedAvg", "difference",
            f"within {AGREEMENT_ROUNDS}"]
    body = [[a.env, str(a.seed), a.detector, f"{a.nr}" if a.nr == a.c else f"{a.nr}/{a.c}", opt_text(a.live),
             opt_text(a.replayed), "-" if a.live is None or a.replayed is None else f"{a.live - a.replayed:+d}",
             "yes" if a.agrees else "**no**"] for a in rows]
    return "\n".join(md_table(head, body))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", metavar="PATH",
                    help="one group each: a campaign directory, a run directory or a NAME.rounds.jsonl file")
    ap.add_argument("--into", default="", help=f"write the tables into this Markdown file between its {BEGIN} and "
                                               f"{END} lines")
    ap.add_argument("--agreement", action="store_true",
                    help="instead: each detect run's live report round against the replay of the same seed's "
                         f"FedAvg run (all PATHs as one campaign); exit 1 when one differs by more than "
                         f"{AGREEMENT_ROUNDS} rounds")
    ap.add_argument("--block", default="", help="with --into: the block's name (<!-- summarize NAME: begin -->)")
    args = ap.parse_args(argv)
    if args.agreement:
        rows = agreement(load_runs(args.paths))
        text = agreement_table(rows)
        print(text)
        if args.into:
            splice(Path(args.into), text, args.block)
        return 0 if all(a.agrees for a in rows) else 1
    groups = [(Path(p).name, vanilla_runs([p])) for p in args.paths]
    for name, runs in groups:
        if not runs:
            print(f"nfl_guard: {name}: no run with nfl = off", file=sys.stderr)
            return 2
    text = tables(groups)
    print(text)
    if args.into:
        splice(Path(args.into), text, args.block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
