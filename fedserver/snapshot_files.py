"""The state store's model files and the verification of a stored snapshot before a federation carries on from it.

A snapshot verifies when its state record is a JSON object, every model file it names is one of the store's own
files in ``models/`` with the recorded size and sha256 (and, with ``parse``, loads as the recorded model), and its
history rows are all there and JSON objects; otherwise :class:`Unverified` says why, and
:meth:`fedserver.store.StateStore.load` tries the next older snapshot. Apart from the store's SQLite bookkeeping
because it is a job of its own on plain files and rows (no database, no lock); torch is imported only to parse
tensors, so :func:`fedserver.store.check_state` runs before torch is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MODELS_DIR = "models"
# The store's own files inside models/ (final names and their temp names); nothing else there is touched.
FILE_RE = re.compile(r"r(\d{6,})-([A-Za-z0-9_.-]{1,64})-([0-9a-f]{8})\.fgt(\.tmp)?")
TMP_SUFFIX = ".tmp"


class Unverified(Exception):
    """Why a snapshot failed verification (becomes a line of :attr:`fedserver.store.Loaded.skipped`)."""


def store_file(rel: str) -> str:
    """The file name in ``models/`` of the store-relative path ``rel`` when it names one of the store's own files
    (a final or a temp name), else ``""``."""
    name = rel[len(MODELS_DIR) + 1:] if rel.startswith(MODELS_DIR + "/") else ""
    return name if FILE_RE.fullmatch(name) else ""


def parse_state(state_text: str) -> dict[str, Any]:
    try:
        state = json.loads(state_text)
    except (ValueError, TypeError, RecursionError) as e:  # RecursionError: nested too deeply
        raise Unverified(f"its state record is not valid JSON ({e})") from None
    if not isinstance(state, dict):
        raise Unverified(f"its state record is a JSON {type(state).__name__}, not an object")
    return state


def verify_models(models_dir: Path, models: Sequence[tuple[str, str, str, int]],
                  parse: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """The snapshot's models by id from its rows (model id, path, sha256, bytes); with ``parse=False`` the files
    are checked (size, sha256) and no tensors are returned."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for model_id, rel, digest, size in models:
        what = f"model {model_id!r} ({rel})"
        name = store_file(rel)
        if not name or name.endswith(TMP_SUFFIX):
            raise Unverified(f"{what} is not a path inside the store's {MODELS_DIR}/ folder")
        path = models_dir / name
        try:
            with open(path, "rb") as f:
                got_size = os.fstat(f.fileno()).st_size
                if got_size != size:
                    raise Unverified(f"{what} has {got_size} bytes, {size} were written: truncated or half-written")
                h = hashlib.sha256()
                while block := f.read(1 << 20):
                    h.update(block)
                got = h.hexdigest()
        except FileNotFoundError:
            raise Unverified(f"{what} is missing") from None
        except OSError as e:
            raise Unverified(f"{what} cannot be read ({e.strerror or e})") from None
        if got != digest:
            raise Unverified(f"{what} fails its sha256 checksum: corrupt or half-written")
        if not parse:
            continue
        from fedcore.serialization import SerializationError, load_state

        try:
            tensors, extra = load_state(path)
        except (SerializationError, ValueError, OSError) as e:
            raise Unverified(f"{what} cannot be parsed ({e})") from None
        if extra.get("model_id", model_id) != model_id:
            raise Unverified(f"{what} holds model {extra.get('model_id')!r}")
        out[model_id] = tensors
    return out


def parse_history(rows: Sequence[tuple[int, str]], history_len: int) -> list[dict[str, Any]]:
    """The history rows (seq, report JSON) a snapshot covers: all ``history_len`` of them, each a JSON object."""
    if len(rows) != history_len or (rows and rows[-1][0] != history_len - 1):
        raise Unverified(f"its history has {len(rows)} of the {history_len} rows it covers")
    out: list[dict[str, Any]] = []
    for seq, text in rows:
        try:
            row = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise Unverified(f"history row {seq} is not valid JSON ({e})") from None
        if not isinstance(row, dict):
            raise Unverified(f"history row {seq} is not a JSON object")
        out.append(row)
    return out
