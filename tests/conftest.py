from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from fedcore.log import configure_logging

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = ROOT.parent / "shared" / "data"

# Tests run with torch on few threads: the CI machine has 2 cores and servers/clients share them.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True, scope="session")
def _quiet_logs() -> None:
    configure_logging(level="warning")


def pytest_configure(config: pytest.Config) -> None:
    import torch

    torch.set_num_threads(1)


SYSTEM_TESTS = "tests/system/"  # real processes and real timeouts: run first, one at a time


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The system tests come first (the longest unit of work starts first under pytest-xdist)."""
    items.sort(key=lambda item: not item.nodeid.startswith(SYSTEM_TESTS))  # stable: the order within each kind


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``tools/test.sh`` runs two workers) the system tests are one unit of work, so one worker
    runs them one after another while the other takes the unit and integration tests: their timings were set for a
    CI machine of two cores, and two of them at once would share one core each. (By directory, not by the
    ``system`` mark: ``--dist loadgroup``'s ``xdist_group`` marks are lost on pytest 9.2, pytest-xdist issue 1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class SystemTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SYSTEM_TESTS if nodeid.startswith(SYSTEM_TESTS) else nodeid

    return SystemTestsTogether(config, log)
