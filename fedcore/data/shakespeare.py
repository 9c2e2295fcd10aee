"""Shakespeare next-character prediction, one client per speaking role of one play (LEAF "by role").

Reads the CSV plays (``act,scene,character,dialogue,line_number``) in a local folder; rows whose character
starts with ``[`` are stage directions and are skipped. A role's text is its dialogue lines joined with spaces,
every run of whitespace collapsed to one space (LEAF replaces line breaks with spaces). Samples are LEAF's:
every 80-character window of a role's text (stride 1) is an input, the character after it the label.

Symbols are encoded with LEAF's fixed 80-symbol vocabulary :data:`LEAF_VOCAB`. Symbols outside it are mapped
to one index, :data:`UNKNOWN_INDEX` (the slot of ``}``, which Shakespeare never uses). Index 0 (``\\n``) never
occurs in the encoded text because line breaks become spaces; LINDT's Shakespeare backdoor targets it.

Registered as dataset ``shakespeare``: x int64 [N, 80] symbol indices, y int64 in [0, 80). Default partition
``natural`` (by role; ``num_clients`` samples that many roles at random, ``min_size`` drops roles with fewer
windows — FL-GUARD keeps roles with >= 10,000). Its default split is ``contiguous``: the first 90% of a role's
windows train, the last 10% test, and the 79 windows in between (which overlap both) are dropped, as LEAF does.
Own options: ``data_dir``, ``seq_len`` (80).
"""

from __future__ import annotations

import csv
import functools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcore.data.base import DataError, SampleShape, size_option
from fedcore.data.loaders import Pool, federated_dataset, readonly
from fedcore.data.paths import candidate_roots, missing_message

LEAF_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
VOCAB_SIZE = len(LEAF_VOCAB)
UNKNOWN_INDEX = LEAF_VOCAB.index("}")
SEQ_LEN = 80
_COLUMNS = ("character", "dialogue")
_WS = re.compile(r"\s+")
_LUT = np.full(256, UNKNOWN_INDEX, dtype=np.uint8)
for _i, _ch in enumerate(LEAF_VOCAB):
    _LUT[ord(_ch)] = _i


def encode(text: str) -> np.ndarray:
    """Symbol indices (uint8) of ``text``; symbols outside :data:`LEAF_VOCAB` become :data:`UNKNOWN_INDEX`."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    out = np.full(len(points), UNKNOWN_INDEX, dtype=np.uint8)
    small = points < 256
    out[small] = _LUT[points[small]]
    return out


def decode(indices: np.ndarray | torch.Tensor | list[int]) -> str:
    return "".join(LEAF_VOCAB[int(i)] for i in np.asarray(indices).reshape(-1))


@dataclass(frozen=True)
class Role:
    play: str
    character: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.play}/{self.character}"

    def num_samples(self, seq_len: int = SEQ_LEN) -> int:
        return max(0, len(self.text) - seq_len)


def shakespeare_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    looked: list[Path] = []
    for root in candidate_roots(data_dir):
        for d in (root, root / "shakespeare"):
            looked.append(d)
            if d.is_dir() and _play_files(d):
                return d
    raise DataError(missing_message("Shakespeare", looked, ["<play>.csv with columns character,dialogue"]))


def _play_files(d: Path) -> list[Path]:
    out = []
    for p in sorted(d.glob("*.csv")):
        with open(p, encoding="utf-8", newline="") as f:
            header = next(csv.reader(f), [])
        if all(c in header for c in _COLUMNS):
            out.append(p)
    return out


@functools.lru_cache(maxsize=4)
def _load_roles(directory: str) -> tuple[Role, ...]:
    roles: dict[tuple[str, str], list[str]] = {}
    for path in _play_files(Path(directory)):
        with open(path, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f):
                who = (row.get("character") or "").strip()
                if not who or who.startswith("["):
                    continue
                roles.setdefault((path.stem, who), []).append(row.get("dialogue") or "")
    out = []
    for (play, who), lines in sorted(roles.items()):
        text = _WS.sub(" ", " ".join(lines)).strip()
        out.append(Role(play, who, text))
    return tuple(out)


def shakespeare_roles(data_dir: str | os.PathLike[str] | None = None) -> tuple[Role, ...]:
    """Every speaking role of every play in the folder, sorted by (play, character); cached per folder."""
    return _load_roles(str(shakespeare_dir(data_dir).resolve()))


@dataclass(frozen=True, eq=False)
class _Windows:
    codes: np.ndarray  # every role's encoded text, concatenated
    starts: np.ndarray  # start offset in codes of every window
    labels: np.ndarray
    groups: np.ndarray  # role id of every window
    names: tuple[str, ...]


@functools.lru_cache(maxsize=4)
def _windows(directory: str, seq_len: int) -> _Windows:
    roles = _load_roles(directory)
    codes_parts, starts, groups = [], [], []
    offset = 0
    for rid, role in enumerate(roles):
        c = encode(role.text)
        n = max(0, len(c) - seq_len)
        codes_parts.append(c)
        starts.append(offset + np.arange(n, dtype=np.int64))
        groups.append(np.full(n, rid, dtype=np.int64))
        offset += len(c)
    codes = np.concatenate(codes_parts) if codes_parts else np.empty(0, np.uint8)
    st = np.concatenate(starts) if starts else np.empty(0, np.int64)
    labels = codes[st + seq_len].astype(np.int64)
    return _Windows(readonly(codes), readonly(st), readonly(labels), readonly(np.concatenate(groups)),
                    tuple(r.name for r in roles))


def windows_to_tensor(codes: np.ndarray, starts: np.ndarray, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """int64 [len(starts), seq_len] windows of ``codes``."""
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len, dtype=np.int64)
    return torch.from_numpy(codes[idx].astype(np.int64))


def shakespeare_sample(options: Mapping[str, Any]) -> SampleShape:
    """One window of ``seq_len`` symbol indices; the label is one of the 80 symbols."""
    return SampleShape((size_option(options["seq_len"]),), "int64", VOCAB_SIZE)


@federated_dataset("shakespeare", dataset_options=("data_dir", "seq_len"), default_partition="natural",
                   remote_options=("seq_len",), sample=shakespeare_sample)
def shakespeare_pool(seed: int, max_samples: int | None = None, data_dir: str | None = None,
                     seq_len: int = SEQ_LEN) -> Pool:
    """Shakespeare by role (80 classes; x int64 [N, seq_len]); options ``data_dir``, ``seq_len``."""
    if seq_len < 1:
        raise DataError(f"shakespeare: seq_len must be >= 1, got {seq_len}")
    w = _windows(str(shakespeare_dir(data_dir).resolve()), int(seq_len))

    def features(idx: np.ndarray) -> torch.Tensor:
        return windows_to_tensor(w.codes, w.starts[np.asarray(idx, dtype=np.int64)], seq_len)

    return Pool("shakespeare", w.labels, VOCAB_SIZE, features, groups=w.groups, class_names=tuple(LEAF_VOCAB),
                group_kind="role", group_names=dict(enumerate(w.names)), natural_split="contiguous",
                split_gap=seq_len - 1)
