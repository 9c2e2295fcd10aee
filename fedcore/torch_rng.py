"""torch generators seeded by :func:`fedcore.seeds.derive_seed`, and the forked, seeded global RNG.

Kept apart from :mod:`fedcore.seeds` so that deriving a seed imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fedcore.seeds import GLOBAL_RNG_LOCK, derive_seed


def generator(*parts: int | str, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded with :func:`derive_seed` of ``parts``."""
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(*parts))
    return g


@contextmanager
def seeded_global_rng(seed: int) -> Iterator[None]:
    """Hold :data:`GLOBAL_RNG_LOCK`, fork torch's global RNG and seed it with ``seed``; restore it on exit.

    For code that can only draw from the global RNG (``nn`` layers' default initialisation). The CPU generator
    is always forked and seeded; CUDA generators too when CUDA is already initialised (it is not initialised
    here, so a CPU-only run does not create a CUDA context). Determinism also needs every *other* thread that
    draws from the global RNG to hold the lock (:func:`fedcore.models.build_model` does).
    """
    with GLOBAL_RNG_LOCK:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        devices = list(range(torch.cuda.device_count())) if cuda else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed_all(seed)
            yield
