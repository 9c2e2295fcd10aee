"""Seed derivation: every random draw comes from a generator seeded by what it is for, not from torch's global RNG.

Scheme
------
A seed is :func:`derive_seed` of a tuple of parts, by convention ``(federation seed, client id, round, purpose)``
with the parts that do not apply left out:

- a client's training batches in round r: ``derive_seed(seed, client_id, r, BATCHES)``;
- its dropout masks in round r: ``derive_seed(seed, client_id, r, DROPOUT)``;
- an attacker's poisoned batches in round r: ``derive_seed(seed, client_id, r, ATTACK)``
  (:func:`round_seeds` returns these three);
- its private model: ``derive_seed(seed, client_id, PRIVATE)``, from which
  :func:`fedcore.metrics.train_private_model` derives ``PRIVATE_INIT``, ``PRIVATE_BATCHES`` and
  ``PRIVATE_DROPOUT``;
- the server's aggregation noise in round r: ``derive_seed(seed, r, "aggregation_noise")``;
- adaptive clipping's count noise in round r: ``derive_seed(seed, r, "adaptive_clip_count")``.

:func:`derive_seed` hashes a canonical, typed encoding of the parts with BLAKE2b (never Python's ``hash()``, which
is salted per process), so a seed is the same in every process, thread, platform and Python version, and two
different part tuples collide only with probability ~2^-63. ``derive_seed(1, 23)`` and ``derive_seed(12, 3)``
and ``derive_seed("1", 23)`` all differ.

Draws that torch can only make from its process-global RNG (the default initialisers of ``nn`` layers) run under
:data:`GLOBAL_RNG_LOCK`, with the global RNG forked and seeded (:func:`fedcore.torch_rng.seeded_global_rng`), so that
threads that build models concurrently (in-process "virtual" clients) cannot interleave their draws. This module is
torch-free (configuration and seeds need no torch); the torch generators are in :mod:`fedcore.torch_rng`.
"""

from __future__ import annotations

import hashlib
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# ---- purposes ----
BATCHES = "batches"
DROPOUT = "dropout"
ATTACK = "attack"
ATTACK_EPOCH = "attack_epoch"
PRIVATE = "private"
PRIVATE_INIT = "private_init"
PRIVATE_BATCHES = "private_batches"
PRIVATE_DROPOUT = "private_dropout"
MODEL_INIT = "model_init"

SEED_BITS = 63
_MASK = (1 << SEED_BITS) - 1
_PERSON = b"fedguard-seed-v1"  # BLAKE2b personalisation (16 bytes): changing the scheme changes this

# Held while code draws from torch's process-global RNG (seeded model construction, any model construction
# through fedcore.models.build_model). Re-entrant: a seeded factory may call build_model.
GLOBAL_RNG_LOCK = threading.RLock()


def _encode(part: int | str) -> bytes:
    if isinstance(part, str):
        tag, payload = b"s", part.encode("utf-8")
    elif isinstance(part, bool):
        raise TypeError("derive_seed: bool is not a seed part (use an int or a str)")
    else:
        try:
            value = operator.index(part)
        except TypeError:
            raise TypeError(f"derive_seed: parts must be int or str, got {type(part).__name__}") from None
        tag, payload = b"i", str(value).encode("ascii")
    return tag + len(payload).to_bytes(8, "little") + payload


def derive_seed(*parts: int | str) -> int:
    """A stable seed in [0, 2^63) from ``parts`` (ints and strs), e.g. ``(seed, client_id, round, purpose)``.

    Equal parts give equal seeds in every process; the type of a part counts (``1`` and ``"1"`` differ).
    """
    return _seed_of(_hashed(len(parts), parts))


def _hashed(count: int, parts: Sequence[int | str]) -> Any:
    """The BLAKE2b state after the part count ``count`` and the first ``parts`` (``count`` may be larger: the rest
    are added later, as :func:`round_seeds` adds each purpose to a copy of one shared prefix)."""
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update(count.to_bytes(8, "little"))
    for p in parts:
        h.update(_encode(p))
    return h


def _seed_of(h: Any) -> int:
    return int.from_bytes(h.digest(), "little") & _MASK


@dataclass(frozen=True)
class RoundSeeds:
    """The seeds of one client's local training in one round."""

    batches: int
    dropout: int
    attack: int


def round_seeds(federation_seed: int, client_id: str, round_: int) -> RoundSeeds:
    """``derive_seed(federation_seed, client_id, round_, purpose)`` for the batches, dropout and attack purposes."""
    prefix = _hashed(4, (federation_seed, client_id, round_))  # hashed once, finished per purpose

    def purpose(name: str) -> int:
        h = prefix.copy()
        h.update(_encode(name))
        return _seed_of(h)

    return RoundSeeds(batches=purpose(BATCHES), dropout=purpose(DROPOUT), attack=purpose(ATTACK))


def private_seed(federation_seed: int, client_id: str) -> int:
    """The root seed of a client's private model: ``derive_seed(federation_seed, client_id, PRIVATE)``."""
    return derive_seed(federation_seed, client_id, PRIVATE)
