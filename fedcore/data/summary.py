"""Print the per-client summary of a federated dataset partition (sizes, classes, class histogram) and totals.

    python -m fedcore.data.summary --dataset mnist --num-clients 100 --partition noniid-mixed --seed 0
    python -m fedcore.data.summary --dataset shakespeare --option min_size=10000
    python -m fedcore.data.summary --dataset cifar10 --partition types --option num_types=5 --data-dir DIR

Only labels are read (CIFAR-10 JPEGs are not decoded). ``--option key=value`` passes any dataset option; the value
is read as a TOML literal (``alpha=0.5``, ``mixed_groups=[[0.5, 10], [0.5, 2]]``), bare words as strings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from fedcore.data.base import DataError
from fedcore.data.loaders import PartitionSummary, describe_partition, pooled_datasets
from fedcore.errors import ConfigError
from fedcore.options import parse_override


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fedcore.data.summary", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", required=True, choices=pooled_datasets())
    p.add_argument("--num-clients", type=int, default=None, help="clients (default 100; natural: every group)")
    p.add_argument("--partition", default=None, help="iid, noniid-<k>, noniid-mixed, dirichlet, types, natural")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="folder with the data (default: $FEDGUARD_DATA_DIR or "
                                                    "<repo>/../shared/data)")
    p.add_argument("--max-samples", type=int, default=None, help="subsample the pool first")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="any dataset option")
    p.add_argument("--max-classes-shown", type=int, default=12,
                   help="histogram entries shown per client, largest first (0 = all)")
    return p.parse_args(argv)


def options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for item in args.option:
        try:
            keys, value = parse_override(item)
        except ConfigError as e:
            raise DataError(str(e)) from None
        opts[".".join(keys)] = value
    for key, value in (("num_clients", args.num_clients), ("partition", args.partition),
                       ("data_dir", args.data_dir), ("max_samples", args.max_samples)):
        if value is not None:
            opts[key] = value
    return opts


def _histogram(hist: Sequence[int], names: Sequence[str], limit: int) -> str:
    held = sorted(((c, k) for k, c in enumerate(hist) if c > 0), key=lambda t: (-t[0], t[1]))
    shown = held if limit <= 0 else held[:limit]
    text = " ".join(f"{_label(names, k)}:{c}" for c, k in shown)
    return text + (f" (+{len(held) - len(shown)} more)" if len(shown) < len(held) else "")


def _label(names: Sequence[str], k: int) -> str:
    if k < len(names) and names[k].isprintable() and names[k].strip() and " " not in names[k]:
        return names[k]
    return str(k)


def print_summary(s: PartitionSummary, out: TextIO, max_classes_shown: int = 12) -> None:
    tag = s.tag_kind or ""
    out.write(f"dataset={s.dataset} partition={s.partition} clients={len(s.clients)} classes={s.num_classes} "
              f"pool={s.pool_size}\n")
    out.write(f"{'client':>6} {'train':>7} {'test':>6} {'classes':>7}  {tag + '  ' if tag else ''}histogram\n")
    for c in s.clients:
        label = f"{c.tag}  " if tag else ""
        out.write(f"{c.index:>6} {c.num_train:>7} {c.num_test:>6} {c.num_classes_held:>7}  {label}"
                  f"{_histogram(c.histogram, s.class_names, max_classes_shown)}\n")
    sizes = [c.num_samples for c in s.clients]
    classes = [c.num_classes_held for c in s.clients]
    totals = [sum(col) for col in zip(*(c.histogram for c in s.clients), strict=True)]
    out.write(f"total: {len(sizes)} clients, {s.total_samples} samples of {s.pool_size} "
              f"({sum(c.num_train for c in s.clients)} train, {sum(c.num_test for c in s.clients)} test); "
              f"per client mean {statistics.fmean(sizes):.1f} std {statistics.pstdev(sizes):.1f} "
              f"min {min(sizes)} max {max(sizes)}; classes per client mean {statistics.fmean(classes):.2f} "
              f"min {min(classes)} max {max(classes)}\n")
    out.write(f"total per class: {_histogram(totals, s.class_names, 0)}\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = describe_partition(args.dataset, args.seed, options_from_args(args))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(summary, sys.stdout, args.max_classes_shown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
