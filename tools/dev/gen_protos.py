"""Regenerate the committed Python code of the wire contract from ``protos/``.

    python tools/dev/gen_protos.py            # write fedguard/v1/*_pb2*.py(i)
    python tools/dev/gen_protos.py --out DIR  # write into DIR instead (the drift test compares the two)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO_FILES = sorted(p.relative_to(ROOT / "protos") for p in (ROOT / "protos").rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # dev dependency, pinned in pyproject.toml

    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *[str(p) for p in PROTO_FILES]]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted(p for p in out.rglob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    args = ap.parse_args(argv)
    for p in generate(args.out):
        print(p.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
