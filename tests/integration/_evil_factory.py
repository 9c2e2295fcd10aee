"""Importing this module is what a hostile server would like a client to do: it leaves a marker file."""

import os
from pathlib import Path

Path(os.environ.get("FEDGUARD_EVIL_MARKER", "/tmp/fedguard-evil-imported")).write_text("imported")


def factory(**kwargs: object) -> None:
    raise AssertionError("a hostile factory ran")
