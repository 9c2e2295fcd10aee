"""Heavy optional packages stay out of the processes that do not need them (issue 30, item 5).

A client, a server and a host of virtual clients import torch, grpc and numpy; torchvision (only a dataset download
needs it), matplotlib (``fedguard-launch plot``), ray (``--ray`` hosts) and PIL (reading an image dataset) are
imported where they are used. Each check runs in a fresh interpreter, so what an earlier test imported does not
count; the first test shows that the probe does see a module that was imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY = ("torchvision", "matplotlib", "ray", "PIL")

# What a client, a server and a host process import to run (their entry points and the modules they run).
RUNTIME_IMPORTS = ("import fedclient, fedserver, fedlaunch\n"
                   "import fedclient.cli, fedclient.client, fedclient.setup, fedclient.runner\n"
                   "import fedserver.cli, fedserver.app, fedserver.coordinator, fedserver.servicer\n"
                   "import fedlaunch.cli, fedlaunch.hosts\n"
                   "from fedcore.data import load_client_data\n"
                   "from fedcore.models import build_model\n"
                   "load_client_data('synthetic', 0, 0)\n"
                   "build_model('mlp', {'hidden': [64]})\n")


def top_level_modules(code: str, argv: tuple[str, ...] = ()) -> set[str]:
    """The top-level package names in ``sys.modules`` of a fresh interpreter after it ran ``code`` (a SystemExit,
    as from ``--help``, ends the code, not the probe)."""
    probe = ("import json, sys\n"
             f"try:\n    exec({code!r})\nexcept SystemExit:\n    pass\n"
             "sys.stderr.write('\\nMODULES ' + json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", probe, *argv], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    line = res.stderr.rpartition("\nMODULES ")[2]
    return set(json.loads(line))


def test_the_probe_sees_an_imported_module() -> None:
    assert "xml" not in top_level_modules("pass")
    assert "xml" in top_level_modules("import xml.dom")


def test_runtime_imports_leave_the_heavy_packages_out() -> None:
    modules = top_level_modules(RUNTIME_IMPORTS)
    assert {"torch", "grpc", "fedclient", "fedserver", "fedlaunch"} <= modules  # the imports did run
    assert sorted(modules & set(LAZY)) == []


@pytest.mark.parametrize("package", ["fedserver", "fedclient", "fedlaunch"])
def test_help_does_not_import_torch(package: str) -> None:
    code = f"import runpy\nrunpy.run_module({package!r}, run_name='__main__', alter_sys=True)"
    modules = top_level_modules(code, ("--help",))
    assert package in modules
    assert sorted(modules & {"torch", *LAZY}) == []
