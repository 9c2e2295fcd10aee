"""Where the real datasets live on disk.

Order of precedence: the ``data_dir`` option, then the environment variable ``FEDGUARD_DATA_DIR``, then
``<repo>/../shared/data`` when it exists (the layout of the development machines). Nothing is ever
downloaded unless a loader is called with ``download=True``; downloads go to the chosen data directory,
or to ``~/.cache/fedguard/data`` when none is set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from fedcore.data.base import DataError

ENV_VAR = "FEDGUARD_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
SHARED_DATA_DIR = REPO_ROOT.parent / "shared" / "data"
DOWNLOAD_CACHE_DIR = Path("~/.cache/fedguard/data").expanduser()


def candidate_roots(data_dir: str | os.PathLike[str] | None) -> list[Path]:
    """The roots a loader looks in: only the explicit ``data_dir`` when given, else only ``FEDGUARD_DATA_DIR``
    when set, else the shared folder. An explicit folder is never replaced by another copy of the data found
    elsewhere: when it does not hold the data, the loader says so (:func:`missing_message`)."""
    if data_dir is not None and str(data_dir) != "":
        return [Path(data_dir).expanduser()]
    env = os.environ.get(ENV_VAR, "")
    if env:
        return [Path(env).expanduser()]
    return [SHARED_DATA_DIR]


def find_dataset_dir(data_dir: str | os.PathLike[str] | None, subdirs: Sequence[str],
                     required: Sequence[str], what: str, hint: str = "") -> Path:
    """The first of ``root``, ``root/<subdir>`` ... that holds every file in ``required``.

    A required name ``f`` also matches ``f.gz``. Raises :class:`DataError` saying where it looked.
    """
    looked: list[Path] = []
    for root in candidate_roots(data_dir):
        for d in [root, *(root / s for s in subdirs)]:
            looked.append(d)
            if d.is_dir() and all(_exists(d, f) for f in required):
                return d
    raise DataError(missing_message(what, looked, required, hint))


def missing_message(what: str, looked: Sequence[Path], required: Sequence[str], hint: str = "") -> str:
    where = ", ".join(str(p) for p in looked)
    need = ", ".join(required)
    gone = f"; {looked[0]} does not exist" if looked and not looked[0].exists() else ""
    msg = (f"{what}: data not found (looked in {where}{gone}; need {need}). Point at the folder that holds it "
           f"with the dataset option data_dir=... or the environment variable {ENV_VAR}")
    return f"{msg}; {hint}" if hint else msg


def download_root(data_dir: str | os.PathLike[str] | None) -> Path:
    """Where ``download=True`` writes: the explicit or environment data dir, else the user cache."""
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get(ENV_VAR, "")
    return Path(env).expanduser() if env else DOWNLOAD_CACHE_DIR


def is_inside(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
    except ValueError:
        return False
    return True


def _exists(d: Path, name: str) -> bool:
    return (d / name).exists() or (d / f"{name}.gz").exists()
