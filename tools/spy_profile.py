"""Sample a running server with py-spy while a benchmark's timed rounds run, and say where its GIL-held time goes.

``py-spy record --gil`` samples a thread only while it holds the GIL, so an event loop parked in ``epoll_wait`` is not
counted (py-spy's default mode counts it as busy, and its ``--native`` mode stops the process for each sample). The
raw samples (one line per stack, ``frame;frame;... count``) are kept in the file named, and summarized as each
function's share of the samples: its own (the innermost frame) and inclusive. A sample whose innermost Python frame
is the event loop's run call is C code under it with no Python frame: the loop's callbacks, gRPC aio's Cython, futures
and timers -- reported as "the event loop's own C code".

``tools/bench_rounds.py --py-spy FILE`` starts py-spy when the warm-up rounds are done and stops it when the last
timed round completes. Use it with ``--pin-server``: a thread that holds the GIL while the OS runs another process
on its core is still sampled, so on cores shared with the clients the shares are of wall time, not CPU (1,000 @ K =
100 unpinned: 2,790 samples, 11.2 s "holding the GIL", in a window where the server used ~5.4 s of CPU; pinned:
1,025 samples, 4.1 s of ~5.5 s). py-spy is not a fedguard dependency (``pip install py-spy``); attaching to a
process needs ptrace rights over it (root, or ``kernel.yama.ptrace_scope`` = 0 for one's own processes).
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

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([py_spy(), "record", "-p", str(self.pid), "--gil", "-r", str(RATE_HZ), "-f",
                                      "raw", "-o", str(self.out)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)

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


def summarize(path: Path, top: int = 15) -> list[str]:
    """Lines that say where the samples in ``path`` (py-spy's raw format) fall: each function's own and inclusive
    share, and the event loop's own C code."""
    own: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if total == 0:
        return ["py-spy: no samples"]
    loop = sum(own[f] for f in LOOP_FRAMES)
    out = [f"{total:,} samples of the server holding the GIL ({RATE_HZ} Hz); the event loop's own C code (no Python "
           f"frame under its run call: gRPC aio's Cython, uvloop's callbacks, futures, timers): {loop / total:.1%}",
           "  own   incl  function"]
    for f, _ in incl.most_common():
        if len(out) >= top + 2:
            break
        if f.startswith("<module>") or f.startswith("_run_") or f in LOOP_FRAMES or f.startswith("main ") \
                or f.startswith("run (event_loop"):
            continue
        out.append(f"{own[f] / total:5.1%} {incl[f] / total:6.1%}  {f}")
    return out
