"""The demo federation (tools/demo.sh: 40 clients, 40 rounds, NFL reported and recovered) with and without secure
aggregation, side by side: per round β̂, the NFL state, Δ, and whether the final models are bit-identical.

    python tools/experiments/secagg_demo.py --out runs/secagg_demo               # run both (about 4 minutes on 2 cores)
    python tools/experiments/secagg_demo.py --out runs/secagg_demo --into docs/results/secagg_demo.md

β̂ is each device's scalar, sent in the clear in both runs; Δ = w_div − ‖noise‖ is LINDT Eq. 7, whose w_div is the
mean of ‖u_i − g‖ (a CountSketch estimate) in the plain run and the exact weighted root mean square of ‖c_i − g‖ under
secure aggregation (fedcore.secagg.aggregate: the server never sees an update, only the sum of the squared norms).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SECURE = ["--server-set", 'aggregation.secure="secagg+"']


def run(out: Path, secure: bool) -> Path:
    run_dir = out / ("secure" if secure else "plain")
    cmd = ["bash", str(ROOT / "tools" / "demo.sh"), "--run-dir", str(run_dir), "--torch-threads", "1",
           *(SECURE if secure else [])]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return run_dir


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]


def _same_model(a: Path, b: Path) -> bool:
    from fedcore.serialization import load_state

    x, _ = load_state(a / "final_model.fgt")
    y, _ = load_state(b / "final_model.fgt")
    return x.keys() == y.keys() and all(x[k].numpy().tobytes() == y[k].numpy().tobytes() for k in x)


def report(plain: Path, secure: Path) -> str:
    a, b = _rows(plain), _rows(secure)
    if [r["round"] for r in a] != [r["round"] for r in b]:
        raise SystemExit("the two runs did not complete the same rounds")
    same_beta = sum(x["beta_hat"] == y["beta_hat"] for x, y in zip(a, b, strict=True))
    same_nfl = sum(x["nfl"] == y["nfl"] and x["recovery"] == y["recovery"] for x, y in zip(a, b, strict=True))
    ratios = [y["metrics"]["delta"] / x["metrics"]["delta"] for x, y in zip(a, b, strict=True)
              if x["metrics"]["delta"]]
    reported = next((y["round"] for y in b if y["nfl"] == "reported"), None)
    cancelled = next((y["round"] for y in b if reported and y["round"] > reported and y["nfl"] != "reported"), None)
    lines = [
        f"- rounds: {len(a)}; final models bit-identical: **{_same_model(plain, secure)}**",
        f"- β̂ identical in {same_beta}/{len(a)} rounds; NFL state and recovery identical in {same_nfl}/{len(a)}",
        f"- under secure aggregation NFL is reported at round {reported} and the report cancelled at round "
        f"{cancelled} (recovery goes on)",
        f"- Δ secure / Δ plain: {min(ratios):.3f} to {max(ratios):.3f} (the RMS of ‖c_i − g‖ vs the mean of "
        "‖u_i − g‖: docs/security.md, 'What the server learns')",
        "",
        "| round | β̂ (both) | NFL (both) | Δ plain | Δ secure | survivors | dropped |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for x, y in zip(a, b, strict=True):
        m = y["metrics"]
        lines.append(f"| {x['round']} | {y['beta_hat']:+.4f} | {y['nfl']}{'+rec' if y['recovery'] else ''} | "
                     f"{x['metrics']['delta']:.4f} | {m['delta']:.4f} | {m['secagg_survivors']:.0f} | "
                     f"{m['secagg_dropped']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "secagg_demo")
    ap.add_argument("--into", type=Path, help="also write the report to this markdown file")
    ap.add_argument("--no-run", action="store_true", help="only report on the runs already in --out")
    args = ap.parse_args(argv)
    if not args.no_run:
        run(args.out, secure=False)
        run(args.out, secure=True)
    text = report(args.out / "plain", args.out / "secure")
    print(text)
    if args.into is not None:
        header = ("# The demo with secure aggregation\n\n"
                  "`python tools/experiments/secagg_demo.py --out runs/secagg_demo "
                  "--into docs/results/secagg_demo.md`: "
                  "tools/demo.sh's federation (40 clients, 40 rounds, NR = c = 5), once plain and once with "
                  "`aggregation.secure = \"secagg+\"`.\n\n")
        args.into.write_text(header + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
