from __future__ import annotations

import os
from pathlib import Path

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
