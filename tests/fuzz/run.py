"""Run a fuzz target: ``python -m tests.fuzz.run NAME [--seconds S] [--mutations N] [--seed K] [libFuzzer flags]``.

Under atheris (``pip install atheris``), coverage-guided from the target's seed corpus (``tests/fuzz/corpus/NAME``,
new inputs kept in ``runs/fuzz/NAME``, a crashing or hanging input written to ``runs/fuzz/NAME-artifacts/``): the
fuzzer runs in a child process whose libFuzzer output goes to ``runs/fuzz/NAME.log`` (and to the terminal unless
``--quiet``), and the run ends with one line: executions, wall seconds, executions per second, coverage (libFuzzer's
``cov``/``ft``), peak RSS, crashes, hangs (an input running past ``-timeout``, default 10 s) and out-of-memory
inputs (``-rss_limit_mb``, default 2048). Flags libFuzzer knows (``-runs=1000000``, ``-timeout=5``...) pass through.
Without atheris, or with ``--mutations``, a seeded random mutator over the corpus (:func:`mutations`, what the unit
test runs). A finding is an exception the target does not expect: it is printed with its input (hex) and the run
exits 1.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

CORPUS = Path(__file__).resolve().parent / "corpus"
NAMES = ["config_toml", "fgt_file", "frames", "safetensors_model", "session_request", "signed_request",
         "snapshot_rows", "update_header", "update_stream"]
OUT = Path("runs/fuzz")
_INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x00\x00\x00\x00", b"\xff\xff\xff\xff", b"\xff" * 8,
                b"\x00\x00\x00\x80", b"nan", b"inf", b"-1", b"1e308", b'"', b"[", b"{", b"\n", b"="]
# libFuzzer flags the runner sets unless given: a hang is an input running past 10 s, 2 GiB of RSS is too much.
_DEFAULTS = {"-timeout": "10", "-rss_limit_mb": "2048", "-print_final_stats": "1"}


def scratch_root() -> Path:
    """Where the targets write the files they read back (``fedguard-fuzz-<pid>*``): a tmpfs where there is one
    (a file written and read per input costs 2 ms on a busy disk, 10 us in memory)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


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


@dataclass
class Summary:
    """What a coverage-guided run did, from libFuzzer's output and the child's resource usage."""

    name: str
    executions: int = 0
    seconds: float = 0.0  # wall, the child's start-up (imports) included
    fuzz_seconds: int = 0  # libFuzzer's own count ("Done N runs in T second(s)")
    exec_per_s: float = 0.0  # libFuzzer's average_exec_per_sec, else executions over wall seconds
    cov: int = 0
    ft: int = 0
    corpus: int = 0
    peak_rss_mb: int = 0  # the child's ru_maxrss (start-up included)
    fuzz_rss_mb: int = 0  # libFuzzer's peak_rss_mb
    crashes: int = 0
    hangs: int = 0
    ooms: int = 0
    returncode: int = 0

    @property
    def findings(self) -> int:
        return self.crashes + self.hangs + self.ooms

    def line(self) -> str:
        return (f"fuzz {self.name}: {self.executions} executions in {self.seconds:.1f} s ({self.exec_per_s:.0f}/s), "
                f"cov {self.cov} ft {self.ft}, corpus {self.corpus}, peak RSS {self.peak_rss_mb} MB "
                f"(libFuzzer's {self.fuzz_rss_mb} MB), "
                f"crashes {self.crashes}, hangs {self.hangs}, out-of-memory {self.ooms}")


_STATUS = re.compile(r"^#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
_STAT = re.compile(r"^stat::(\w+):\s*(\d+)")
_DONE = re.compile(r"^Done (\d+) runs in (\d+) second")


def parse_output(name: str, lines: Sequence[str], seconds: float, child_rss_mb: int, returncode: int) -> Summary:
    """A :class:`Summary` of libFuzzer's output (its ``#N ... cov: ft: corp:`` status lines, the final
    ``stat::`` lines, its ``ERROR:`` lines). Executions come from ``stat::number_of_executed_units`` (else the last
    status line); peak RSS is the larger of libFuzzer's ``stat::peak_rss_mb`` and the child's ``ru_maxrss``."""
    s = Summary(name, seconds=seconds, returncode=returncode, peak_rss_mb=child_rss_mb)
    stats: dict[str, int] = {}
    for line in lines:
        m = _STATUS.match(line)
        if m:
            s.executions, s.cov, s.ft, s.corpus = (int(g) for g in m.groups())
            continue
        m = _STAT.match(line)
        if m:
            stats[m.group(1)] = int(m.group(2))
        elif m := _DONE.match(line):
            s.fuzz_seconds = int(m.group(2))
        elif "ERROR: libFuzzer: timeout" in line:
            s.hangs += 1
        elif "ERROR: libFuzzer: out-of-memory" in line or "ERROR: libFuzzer: malloc limit" in line:
            s.ooms += 1
        elif "Uncaught Python exception" in line or "ERROR: libFuzzer: deadly signal" in line:
            s.crashes = 1  # atheris prints both for one crash; libFuzzer stops at the first
    s.executions = stats.get("number_of_executed_units", s.executions)
    s.fuzz_rss_mb = stats.get("peak_rss_mb", 0)
    if returncode != 0 and not s.findings:
        s.crashes = 1  # the child died without saying why: count it, the log has the rest
    s.exec_per_s = stats.get("average_exec_per_sec") or (s.executions / seconds if seconds > 0 else 0.0)
    return s


def run_atheris(name: str, seconds: float, flags: Sequence[str], quiet: bool) -> Summary:
    """The coverage-guided run in a child process (libFuzzer ends its process when done)."""
    given = {f.split("=", 1)[0] for f in flags}
    args = [f"-max_total_time={int(seconds)}", *(f"{k}={v}" for k, v in _DEFAULTS.items() if k not in given),
            f"-artifact_prefix={OUT / (name + '-artifacts')}/", *flags]
    (OUT / name).mkdir(parents=True, exist_ok=True)
    (OUT / (name + "-artifacts")).mkdir(parents=True, exist_ok=True)
    log = OUT / f"{name}.log"
    cmd = [sys.executable, "-m", "tests.fuzz.run", name, "--atheris-child", *args]
    start = time.monotonic()
    lines: list[str] = []
    with open(log, "w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               errors="replace") as child:
        assert child.stdout is not None
        for line in child.stdout:
            f.write(line)
            lines.append(line.rstrip("\n"))
            if not quiet:
                sys.stderr.write(line)
        returncode = child.wait()
    wall = time.monotonic() - start
    for scratch in scratch_root().glob(f"fedguard-fuzz-{child.pid}*"):  # the targets' files
        shutil.rmtree(scratch) if scratch.is_dir() else scratch.unlink()
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024  # Linux: kilobytes
    summary = parse_output(name, lines, wall, rss_mb, returncode)
    if summary.findings and quiet:
        sys.stderr.write("\n".join(lines[-60:]) + "\n")
    return summary


def atheris_child(name: str, flags: Sequence[str]) -> None:
    import atheris  # type: ignore[import-untyped]

    with atheris.instrument_imports(include=["fedguard", "fedcore", "fedserver", "tests.fuzz"]):  # our parsers
        from tests.fuzz.targets import TARGETS
    atheris.Setup([sys.argv[0], *flags, str(OUT / name), str(CORPUS / name)], TARGETS[name])
    atheris.Fuzz()


def have_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("name", choices=NAMES)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--mutations", type=int, default=0, help="the random mutator, this many inputs (no atheris)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quiet", action="store_true", help="libFuzzer's output only to runs/fuzz/NAME.log")
    ap.add_argument("--json", type=Path, help="also write the run's summary here (JSON)")
    ap.add_argument("--atheris-child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.atheris_child:
        atheris_child(args.name, rest)
        return 0
    if not args.mutations:
        if have_atheris():
            summary = run_atheris(args.name, args.seconds, rest, args.quiet)
            print(summary.line(), flush=True)
            if args.json is not None:
                args.json.write_text(json.dumps(asdict(summary), indent=1) + "\n")
            return 1 if summary.findings else 0
        args.mutations = 10**9
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
    wall = time.monotonic() - start
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{args.name}: {n} inputs in {wall:.1f} s ({n / wall if wall > 0 else 0:.0f}/s, peak RSS {rss_mb} MB), "
          "no finding")
    return 0


if __name__ == "__main__":
    sys.exit(main())
