"""fedguard-export: a run's per-round numbers as CSV or TensorBoard event files.

    fedguard-export runs/demo --csv                      # runs/demo/rounds.csv
    fedguard-export runs/demo --csv - | column -s, -t    # to stdout
    fedguard-export runs/demo --tensorboard runs/tb/demo # then: tensorboard --logdir runs/tb

RUN is a run directory (its ``rounds.jsonl``) or a rounds file named directly (``docs/results/*.rounds.jsonl``).
Columns and scalars (one row / step per round, see docs/outputs.md): accuracy (the clients' mean local test accuracy
of the model they received, and central accuracy), beta over all and over benign clients, the round's median
beta_hat and the detector's beta_hat, LINDT's Delta and w_div, the NFL state (off, watching, reported, always) and
its count, whether recovery is on, adapting clients, the number of DistFL clusters, the cumulative DP epsilon and its
delta, the train loss and seconds. A number the round does not have is an empty CSV cell and no TensorBoard point.

``--tensorboard`` needs TensorBoard's event writer: ``pip install 'fedguard[tensorboard]'``.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedcore.jsonio import loads
from fedcore.report import row_from_json

NFL_CODES = {"off": 0, "watching": 1, "reported": 2, "always": 3}


class RunFileError(Exception):
    """A run that cannot be read; the message names the file."""


def rounds_path(run: Path) -> Path:
    return run if run.is_file() else run / "rounds.jsonl"


def read_rounds(run: Path) -> list[dict[str, Any]]:
    """The rows of a run's ``rounds.jsonl`` (strict or older NaN rows; ``null`` read as NaN)."""
    path = rounds_path(run)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RunFileError(f"{path}: no such file (is {run} a fedguard run directory?)") from None
    except OSError as e:
        raise RunFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = loads(line)
        except ValueError as e:
            raise RunFileError(f"{path}:{n}: not a JSON row ({e})") from None
        if not isinstance(row, dict) or "round" not in row:
            raise RunFileError(f"{path}:{n}: not a round row")
        rows.append(row_from_json(row))
    return rows


def _metric(name: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda r: r.get("metrics", {}).get(name, math.nan)


def _field(name: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda r: r.get(name, math.nan)


def _clusters(r: Mapping[str, Any]) -> Any:
    c = r.get("clusters") or {}
    return len(c) if c else r.get("metrics", {}).get("distfl_clusters", math.nan)


# (CSV column, TensorBoard tag or "" for none, value of a row)
COLUMNS: tuple[tuple[str, str, Callable[[Mapping[str, Any]], Any]], ...] = (
    ("round", "", _field("round")),
    ("outcome", "", _field("outcome")),
    ("selected", "clients/selected", _field("selected")),
    ("accepted", "clients/accepted", _field("accepted")),
    ("accuracy", "accuracy/local", _field("mean_test_accuracy")),
    ("accuracy_benign", "accuracy/local_benign", _field("test_accuracy_benign")),
    ("central_accuracy", "accuracy/central", _field("central_accuracy")),
    ("beta", "beta/all", _field("beta")),
    ("beta_benign", "beta/benign", _field("beta_benign")),
    ("beta_hat", "beta_hat/round_median", _field("beta_hat")),
    ("beta_hat_avg", "beta_hat/detector", _field("beta_hat_avg")),
    ("delta", "delta/delta", _metric("delta")),
    ("w_div", "delta/w_div", _metric("w_div")),
    ("noise_norm", "delta/noise_norm", _metric("noise_norm")),
    ("nfl", "", _field("nfl")),
    ("nfl_code", "nfl/state", lambda r: NFL_CODES.get(str(r.get("nfl", "")), math.nan)),
    ("nfl_count", "nfl/count", _field("nfl_count")),
    ("recovery", "nfl/recovery", lambda r: int(bool(r.get("recovery", False)))),
    ("adapting", "nfl/adapting_clients", _field("adapting")),
    ("clusters", "distfl/clusters", _clusters),
    ("dp_epsilon", "dp/epsilon", _field("dp_epsilon")),
    ("dp_delta", "", _field("dp_delta")),
    ("train_loss", "train/loss", _field("mean_train_loss")),
    ("seconds", "time/round_seconds", _field("seconds")),
)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ""
    return "" if v is None else str(v)


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow([name for name, _, _ in COLUMNS])
    for r in rows:
        w.writerow([_cell(get(r)) for _, _, get in COLUMNS])
    return out.getvalue()


def write_tensorboard(rows: Sequence[Mapping[str, Any]], logdir: Path) -> int:
    """Write one scalar per tag and round into event files under ``logdir``; returns the points written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RunFileError(f"--tensorboard needs TensorBoard: pip install 'fedguard[tensorboard]' ({e})") from None
    points = 0
    writer = SummaryWriter(log_dir=str(logdir))
    try:
        for r in rows:
            step = int(r["round"])
            for _, tag, get in COLUMNS:
                v = get(r)
                if tag and _finite(v):
                    writer.add_scalar(tag, float(v), step)
                    points += 1
    finally:
        writer.close()
    return points


def main(argv: list[str] | None = None) -> int:
    from fedcore.about import VersionAction

    ap = argparse.ArgumentParser(prog="fedguard-export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action=VersionAction)
    ap.add_argument("run", type=Path, help="run directory or rounds.jsonl file")
    ap.add_argument("--csv", nargs="?", const="", default=None, metavar="FILE",
                    help="write CSV to FILE ('-': stdout; no FILE: RUN/rounds.csv, or NAME.csv beside a rounds file)")
    ap.add_argument("--tensorboard", type=Path, metavar="DIR", help="write TensorBoard event files into DIR")
    args = ap.parse_args(argv)
    if args.csv is None and args.tensorboard is None:
        ap.error("say what to export: --csv [FILE] and/or --tensorboard DIR")
    try:
        rows = read_rounds(args.run)
        if args.csv is not None:
            text = to_csv(rows)
            if args.csv == "-":
                sys.stdout.write(text)
            else:
                dest = Path(args.csv) if args.csv else (
                    args.run / "rounds.csv" if args.run.is_dir()
                    else args.run.with_name(args.run.name.removesuffix(".jsonl").removesuffix(".rounds") + ".csv"))
                _write_new(dest, text)
                print(f"fedguard-export: {len(rows)} rounds -> {dest}", file=sys.stderr)
        if args.tensorboard is not None:
            n = write_tensorboard(rows, args.tensorboard)
            print(f"fedguard-export: {len(rows)} rounds, {n} scalars -> {args.tensorboard}", file=sys.stderr)
    except RunFileError as e:
        print(f"fedguard-export: {e}", file=sys.stderr)
        return 2
    return 0


def _write_new(dest: Path, text: str) -> None:
    """Write ``dest`` via a temp name; an existing file is replaced only when it is an export (CSV with our header)."""
    if dest.exists():
        try:
            first = dest.read_text().partition("\n")[0]
        except (OSError, UnicodeDecodeError):
            first = ""
        if first != ",".join(name for name, _, _ in COLUMNS):
            raise RunFileError(f"{dest}: exists and is not a fedguard-export CSV; nothing was written (choose "
                               "another FILE)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(dest)


if __name__ == "__main__":
    sys.exit(main())
