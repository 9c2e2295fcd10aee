"""Run a fuzz target: ``python -m tests.fuzz.run NAME [--seconds S] [--mutations N] [--seed K]``.

Under atheris (``pip install atheris``), coverage-guided from the target's seed corpus (``tests/fuzz/corpus/NAME``,
new inputs kept in ``runs/fuzz/NAME``); without it, or with ``--mutations``, a seeded random mutator over the
corpus (:func:`mutations`, what the unit test runs). A finding is an exception the target does not expect: it is
printed with its input (hex) and the run exits 1.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
NAMES = ["config_toml", "fgt_file", "frames", "session_request", "signed_request", "update_header"]
_INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\xff" * 8,
                b"\x00\x00\x00\x80", b"nan", b"inf", b"-1", b"1e308", b'"', b"[", b"{", b"\n", b"="]


def corpus(name: str) -> list[bytes]:
    return [p.read_bytes() for p in sorted((CORPUS / name).iterdir()) if p.is_file()]


def mutate(data: bytes, rng: random.Random, pool: Sequence[bytes]) -> bytes:
    """One random edit of ``data``: a bit flip, a byte set, an insertion or deletion, a truncation, an interesting
    value, or a splice with another corpus entry."""
    b = bytearray(data)
    op = rng.randrange(7)
    if op == 0 and b:
        i = rng.randrange(len(b))
        b[i] ^= 1 << rng.randrange(8)
    elif op == 1 and b:
        b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 2:
        i = rng.randrange(len(b) + 1)
        b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 9)))
    elif op == 3 and b:
        i = rng.randrange(len(b))
        del b[i:i + rng.randrange(1, 9)]
    elif op == 4 and b:
        del b[rng.randrange(len(b)):]
    elif op == 5:
        i = rng.randrange(len(b) + 1)
        v = rng.choice(_INTERESTING)
        b[i:i + len(v)] = v
    else:
        other = rng.choice(pool) if pool else b""
        i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
        b = b[:i] + bytearray(other[j:])
    return bytes(b)


def mutations(name: str, count: int, seed: int) -> Iterator[bytes]:
    """The seed corpus of ``name``, then ``count`` inputs, each one to four edits of a corpus entry."""
    pool = corpus(name)
    yield from pool
    rng = random.Random(f"{name}:{seed}")
    for _ in range(count):
        data = rng.choice(pool) if pool else b""
        for _ in range(rng.randrange(1, 5)):
            data = mutate(data, rng, pool)
        yield data


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("name", choices=NAMES)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--mutations", type=int, default=0, help="the random mutator, this many inputs (no atheris)")
    ap.add_argument("--seed", type=int, default=0)
    args, rest = ap.parse_known_args(argv)
    if not args.mutations:
        try:
            import atheris  # type: ignore[import-untyped]
        except ImportError:
            args.mutations = 10**9
        else:
            with atheris.instrument_imports(include=["fedguard", "fedcore", "tests.fuzz"]):  # coverage: our parsers
                from tests.fuzz.targets import TARGETS
            target = TARGETS[args.name]
            out = Path("runs/fuzz") / args.name
            out.mkdir(parents=True, exist_ok=True)
            atheris.Setup([sys.argv[0], f"-max_total_time={int(args.seconds)}", *rest, str(out),
                           str(CORPUS / args.name)], target)
            atheris.Fuzz()
            return 0
    from tests.fuzz.targets import TARGETS

    target = TARGETS[args.name]
    start, n = time.monotonic(), 0
    for data in mutations(args.name, args.mutations, args.seed):
        if time.monotonic() - start > args.seconds:
            break
        try:
            target(data)
        except Exception as e:  # a finding: the parser let an unexpected error out
            print(f"finding in {args.name}: {type(e).__name__}: {e}\ninput: {data.hex()}", file=sys.stderr)
            return 1
        n += 1
    print(f"{args.name}: {n} inputs in {time.monotonic() - start:.1f} s, no finding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
