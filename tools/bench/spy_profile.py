"""Sample a running server with py-spy while a benchmark's timed rounds run, and say where its GIL-held time goes.

``py-spy record --gil`` samples a thread only while it holds the GIL, so an event loop parked in ``epoll_wait`` is not
counted (py-spy's default mode counts it as busy, and its ``--native`` mode stops the process for each sample). The
raw samples (one line per stack, ``frame;frame;... count``) are kept in the file named, and summarized as each
function's share of the samples: its own (the innermost frame) and inclusive. A sample whose innermost Python frame
is the event loop's run call is C code under it with no Python frame: the loop's callbacks, gRPC aio's Cython, futures
and timers -- reported as "the event loop's own C code".

``tools/bench/bench_rounds.py --py-spy FILE`` starts py-spy when the warm-up rounds are done and stops it when the last
timed round completes. Use it with ``--pin-server``: a thread that holds the GIL while the OS runs another process
on its core is still sampled, so on cores shared with the clients the shares are of wall time, not CPU (1,000 @ K =
100 unpinned: 2,790 samples, 11.2 s "holding the GIL", in a window where the server used ~5.4 s of CPU; pinned:
1,025 samples, 4.1 s of ~5.5 s). ``--py-spy-native`` adds py-spy's ``--native``: each sample then carries the C frames
under the Python ones, and the summary also says in which library the innermost frame is (the C library's system
calls, gRPC's core, uvloop, asyncio's C, protobuf, numpy, torch, the interpreter) and which system calls take the
time -- among them the ``eventfd_write`` by which a thread wakes another one blocked on an eventfd (gRPC's core
waking its completion-queue poller thread). Native sampling stops the process for each sample: its shares are
sound, its absolute rate is not the unsampled server's. py-spy is not a fedguard dependency (``pip install
py-spy``); attaching to a process needs ptrace rights over it (root, or ``kernel.yama.ptrace_scope`` = 0 for
one's own processes).
"""

from __future__ import annotations

import collections
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

RATE_HZ = 250
NATIVE_RATE_HZ = 100  # each native sample stops the process to unwind its C stack: sampled less often
# What the innermost frame's library is, by the file py-spy names for it (the first match wins).
LIBRARIES = (
    (("libc.so", "ld-linux"), "the C library (system calls, malloc)"),
    (("cygrpc",), "gRPC (its core and Cython)"),
    (("loop.c", "uvloop"), "uvloop"),
    (("_asynciomodule.c",), "asyncio's C"),
    (("_message",), "protobuf (upb)"),
    (("_multiarray", "numpy"), "numpy"),
    (("torch", "c10"), "torch"),
    (("libcrypto", "libssl"), "OpenSSL"),
)
WAKE = "eventfd_write"
LOOP_FRAMES = ("Runner.run (runners.py)", "BaseEventLoop.run_forever (base_events.py)")


def py_spy() -> str:
    """The py-spy executable, or a SystemExit that says how to get it."""
    exe = shutil.which("py-spy")
    if exe is None:
        raise SystemExit("--py-spy: py-spy is not installed (pip install py-spy)")
    return exe


class Recorder:
    """py-spy recording ``pid`` into ``out`` from :meth:`start` until :meth:`stop` (SIGINT: py-spy writes its
    samples and exits)."""

    def __init__(self, pid: int, out: Path, native: bool = False) -> None:
        self.pid, self.out, self.native = pid, out, native
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        return [py_spy(), "record", "-p", str(self.pid), "--gil", *(["--native"] if self.native else []),
                "-r", str(NATIVE_RATE_HZ if self.native else RATE_HZ), "-f", "raw", "-o", str(self.out)]

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self) -> str:
        """Stop recording; returns py-spy's complaint ("" when it wrote its file)."""
        if self.proc is None:
            return "py-spy never started (the timed rounds did not begin)"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return "" if self.out.exists() else err.decode(errors="replace").strip()[-500:]


def watch(recorder: Recorder, rows: Callable[[], int], first: int, last: int,
          done: threading.Event) -> threading.Thread:
    """A thread that starts ``recorder`` once ``rows()`` reaches ``first`` and stops it at ``last`` (or when ``done``
    is set: the benchmark's processes ended)."""

    def run() -> None:
        started = False
        while not done.wait(0.05):
            n = rows()
            if not started and n >= first:
                recorder.start()
                started = True
            if started and n >= last:
                break
        if started and recorder.proc is not None and recorder.proc.poll() is None:
            recorder.proc.send_signal(signal.SIGINT)

    t = threading.Thread(target=run, name="py-spy-watch", daemon=True)
    t.start()
    return t


def _frame(raw: str) -> str:
    """``function (file:line)`` as ``function (file)`` (the file's name only)."""
    name, _, where = raw.partition(" (")
    return f"{name} ({where.split(':')[0].rsplit('/', 1)[-1]})" if where else raw


def _where(raw: str) -> str:
    """The file (its name only) a raw frame names: ``libc.so.6``, ``servicer.py``, ``loop.c``."""
    return raw.rpartition(" (")[2].rstrip(")").split(":")[0].rsplit("/", 1)[-1]


def library(raw: str) -> str:
    """Which library a raw frame of a ``--native`` sample runs in: one of :data:`LIBRARIES`, Python code, or the
    interpreter (CPython's own C and anything else)."""
    where = _where(raw)
    if where.endswith(".py") or where == "<string>":
        return "Python code"
    for marks, name in LIBRARIES:
        if any(m in where for m in marks):
            return name
    return "the interpreter and other C"


def _samples(path: Path) -> list[tuple[list[str], int]]:
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if stack and count.isdigit():
            out.append((stack.split(";"), int(count)))
    return out


def _native(samples: list[tuple[list[str], int]], total: int) -> list[str]:
    """The ``--native`` lines: the innermost frame's library, and the C library's calls by name."""
    libs: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    wake = 0
    for raw, n in samples:
        lib = library(raw[-1])
        libs[lib] += n
        if lib == LIBRARIES[0][1]:
            calls[raw[-1].rpartition(" (")[0]] += n
        if any(f.startswith(WAKE + " ") for f in raw):
            wake += n
    named = ", ".join(f"{name} {n / total:.1%}" for name, n in calls.most_common(6) if not name.startswith("0x"))
    return ["innermost frame by library: " + ", ".join(f"{name} {n / total:.1%}" for name, n in libs.most_common()),
            f"  the C library's calls: {named or 'none named'}",
            f"  waking a thread blocked on an eventfd ({WAKE}, e.g. gRPC's core waking its completion-queue "
            f"poller): {wake / total:.1%}"]


def summarize(path: Path, top: int = 15) -> list[str]:
    """Lines that say where the samples in ``path`` (py-spy's raw format) fall: each function's own and inclusive
    share, and the event loop's own C code; for ``--native`` samples also the libraries and system calls."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    samples = _samples(path)
    native = any(library(f) != "Python code" for raw, _ in samples for f in raw)
    for raw, n in samples:
        # A native sample's C frames under the loop's run call are the loop's own C code: counted as the run call's.
        frames = [_frame(f) for f in raw if not native or library(f) == "Python code"] or ["(no Python frame)"]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if total == 0:
        return ["py-spy: no samples"]
    loop = sum(own[f] for f in LOOP_FRAMES)
    out = [f"{total:,} samples of the server holding the GIL ({NATIVE_RATE_HZ if native else RATE_HZ} Hz"
           f"{', native' if native else ''}); the event loop's own C code (no Python "
           f"frame under its run call: gRPC aio's Cython, uvloop's callbacks, futures, timers): {loop / total:.1%}",
           "  own   incl  function"]
    for f, _ in incl.most_common():
        if len(out) >= top + 2:
            break
        if f.startswith("<module>") or f.startswith("_run_") or f in LOOP_FRAMES or f.startswith("main ") \
                or f.startswith("run (event_loop"):
            continue
        out.append(f"{own[f] / total:5.1%} {incl[f] / total:6.1%}  {f}")
    return out + (_native(samples, total) if native else [])
