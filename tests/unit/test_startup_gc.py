"""The command-line processes freeze what they built to start and collect their youngest generation less often."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from fedcore.startup_gc import YOUNG_THRESHOLD

ROOT = Path(__file__).resolve().parents[2]


def test_freezing_moves_start_up_objects_out_of_the_collectors_reach_and_raises_the_young_threshold() -> None:
    # In a child process: freezing is for the life of the process, not for pytest's.
    code = (
        "import gc, json\n"
        "import torch\n"
        "from fedcore.startup_gc import freeze_startup_objects\n"
        "before = gc.get_threshold()\n"
        "tracked = len(gc.get_objects())\n"
        "frozen = freeze_startup_objects()\n"
        "class Node:\n"
        "    pass\n"
        "a, b = Node(), Node()\n"
        "a.other, b.other = b, a\n"
        "del a, b\n"
        "collected = gc.collect()\n"
        "print(json.dumps([before, gc.get_threshold(), tracked, frozen, len(gc.get_objects()), collected]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}).stdout
    before, after, tracked, frozen, left, collected = json.loads(out)
    assert after == [YOUNG_THRESHOLD, before[1], before[2]]
    assert frozen >= tracked > 10_000  # torch's and fedcore's objects are frozen
    assert left < 1_000  # what the collector still walks: only what came after
    assert collected >= 2  # a cycle made after the freeze is still collected


def test_only_the_command_line_entry_points_freeze() -> None:
    callers = sorted(str(p.relative_to(ROOT)) for pkg in ("fedcore", "fedserver", "fedclient", "fedlaunch")
                     for p in (ROOT / pkg).rglob("*.py")
                     if "    freeze_startup_objects()" in p.read_text() and p.name != "startup_gc.py")
    assert callers == ["fedclient/cli.py", "fedlaunch/hosts.py", "fedserver/cli.py"]
