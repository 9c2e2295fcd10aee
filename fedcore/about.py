"""What this installation is: fedguard's version and the versions it runs with, for ``--version`` on every CLI.

Torch-free and import-cheap (versions come from the installed distributions' metadata, nothing is imported), so
``fedserver --version`` answers in the time ``--help`` does.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from fedcore import __version__

__all__ = ["VersionAction", "__version__", "dependency_versions", "installed_version", "version_text"]

_DEPENDENCIES = ("torch", "grpcio", "protobuf")


def installed_version(dist: str, missing: str = "not installed") -> str:
    """The installed version of distribution ``dist`` (from its metadata; nothing is imported), else ``missing``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return missing


def dependency_versions() -> dict[str, str]:
    """``{distribution: version}`` of what fedguard runs on (``"not installed"`` where one is missing)."""
    return {dist: installed_version(dist) for dist in _DEPENDENCIES}


def version_text(prog: str) -> str:
    """One line for ``PROG --version``: ``fedserver 0.2.0 (fedguard; Python 3.11.7, torch 2.14.1, ...)``."""
    deps = ", ".join(f"{dist} {ver}" for dist, ver in dependency_versions().items())
    return f"{prog} {__version__} (fedguard; Python {platform.python_version()}, {deps})"


class VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` for the parser's prog on one line (never re-wrapped) and exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str = "print the version and exit") -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        sys.stdout.write(version_text(parser.prog) + "\n")
        parser.exit(0)
