"""Packaging (issue 29 item 5): a wheel built from the repository installs in a clean venv where every CLI runs.

The wheel is built from a copy of the sources (nothing is written into the checkout), installed with ``--no-deps``
into a fresh venv, and that venv finds its dependencies (torch, grpcio, ...) through a ``.pth`` line pointing at the
test's own environment, after the venv's own site-packages: so every ``fedguard`` module the CLIs import comes from
the wheel, not from the checkout (checked), without downloading torch again. ``tools/bench_install.sh --wheel`` does
the same with the dependencies resolved from the package index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from fedcore import __version__

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fedcore", "fedserver", "fedclient", "fedguard", "fedlaunch")
CLIS = ("fedserver", "fedclient", "fedguard-certs", "fedguard-launch")


def _project_scripts() -> list[str]:
    import tomllib

    with (ROOT / "pyproject.toml").open("rb") as fh:
        return sorted(tomllib.load(fh)["project"]["scripts"])


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                           "--wheel-dir", str(out), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("fedguard-*.whl")
    return whl


def test_wheel_carries_version_license_types_and_generated_code(wheel: Path) -> None:
    assert wheel.name.startswith(f"fedguard-{__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    dist_info = f"fedguard-{__version__}.dist-info"
    assert f"{dist_info}/licenses/LICENSE" in names
    for pkg in ("fedcore", "fedserver", "fedclient", "fedlaunch"):
        assert f"{pkg}/py.typed" in names
    assert "fedguard/v1/fedguard_pb2.py" in names and "fedguard/v1/fedguard_pb2.pyi" in names
    assert not any(n.startswith(("tests/", "tools/")) for n in names)
    meta = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    assert f"Version: {__version__}" in meta
    entry_points = zipfile.ZipFile(wheel).read(f"{dist_info}/entry_points.txt").decode()
    for cli in _project_scripts():
        assert f"{cli} = " in entry_points


def test_wheel_installs_in_a_clean_venv_where_every_cli_runs(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # Dependencies from this environment, searched after the venv's own site-packages (where the wheel goes).
    (site / "zz_fedguard_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index",
                           "--quiet", str(wheel)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([str(py), "-c", "import json, fedcore, fedserver, fedclient, fedguard, fedguard.v1, "
                            "fedlaunch; print(json.dumps([m.__file__ for m in (fedcore, fedserver, fedclient, "
                            "fedguard, fedlaunch)]))"],
                           capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert where.returncode == 0, where.stderr
    for file in json.loads(where.stdout):
        assert Path(file).is_relative_to(site), f"{file} is not the wheel's copy (under {site})"

    scripts = _project_scripts()
    assert set(CLIS) <= set(scripts)
    for cli in scripts:
        exe = env_dir / "bin" / cli
        assert exe.exists(), f"the wheel installs no {cli} script"
        ver = subprocess.run([str(exe), "--version"], capture_output=True, text=True, cwd=tmp_path, env=env,
                             timeout=60)
        assert ver.returncode == 0, f"{cli} --version: {ver.stderr}"
        assert ver.stdout.startswith(f"{cli} {__version__} (fedguard; Python ") and "torch " in ver.stdout
        assert "\n" not in ver.stdout.rstrip("\n")
        helped = subprocess.run([str(exe), "--help"], capture_output=True, text=True, cwd=tmp_path, env=env,
                                timeout=60)
        assert helped.returncode == 0 and "usage:" in helped.stdout, f"{cli} --help: {helped.stderr}"
