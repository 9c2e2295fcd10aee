"""The benchmark model as Flower sees it: a list of float32 NumPy arrays with fedguard's MLP shapes.

Imports NumPy only (not flwr), so fedguard's tests check it against fedguard's model registry; bench_flower.py
writes the shapes with :func:`format_shapes`, the ServerApp reads them back with :func:`parse_shapes`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def format_shapes(shapes: Sequence[Sequence[int]]) -> str:
    """``[(64, 60), (64,)]`` -> ``"64x60,64"`` (a run-config value: strings, numbers and booleans only)."""
    if not shapes:
        raise ValueError("no parameter shapes")
    for shape in shapes:
        if not shape or any(int(d) <= 0 for d in shape):
            raise ValueError(f"bad parameter shape {tuple(shape)}")
    return ",".join("x".join(str(int(d)) for d in shape) for shape in shapes)


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """The inverse of :func:`format_shapes`; a malformed string raises ``ValueError`` naming it."""
    shapes: list[tuple[int, ...]] = []
    for part in text.split(","):
        try:
            shape = tuple(int(d) for d in part.strip().split("x"))
        except ValueError:
            raise ValueError(f"bad shapes {text!r}: {part!r} is not like 64x60") from None
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"bad shapes {text!r}: {part!r} has a non-positive dimension")
        shapes.append(shape)
    return shapes


def make_arrays(shapes: Sequence[tuple[int, ...]], seed: int) -> list[npt.NDArray[np.float32]]:
    """Seeded float32 arrays of ``shapes`` (the values do not matter to a no-op round, the bytes do)."""
    rng = np.random.default_rng(seed)
    return [(0.1 * rng.standard_normal(shape)).astype(np.float32) for shape in shapes]
