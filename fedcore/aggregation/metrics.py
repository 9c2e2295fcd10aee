"""Per-round aggregation metrics, in particular LINDT's weight divergence and Delta.

Definitions (n = updates accepted this round, u_i = w_i^r - w^{r-1} the *raw* update as received, i.e.
before clipping; g = w^r - w^{r-1} the final aggregate step, rule output plus DP noise):

- ``w_div`` (LINDT Eq. 5): ``(1/n) Σ_i ||w_i^r - w^r|| = (1/n) Σ_i ||u_i - g||``. The paper (Eq. 5,
  Algorithm 2 line s6) takes w^r to be the *published* global model of Eq. 4, i.e. after clipping,
  aggregation *and the Gaussian noise*; w_i^r are the weights the clients returned, unclipped (its proof
  of Proposition 1 uses that clipping can only shrink ||u_i - u_j||). The sum is over the clients that
  were aggregated (rejected updates are not part of the round), and the divisor is their number n
  (the paper's K, the number of responding clients).
- ``noise_norm``: ``||N(0, sigma^2 I)||`` of the noise vector actually added (0 without noise).
- ``delta`` (LINDT Eq. 7): ``w_div - noise_norm``.
- ``w_div_exact``: 1.0 when w_div is computed exactly from every update, 0.0 when it is the CountSketch
  estimate of streaming FedAvg (each ``||u_i - g||`` estimated with relative standard error about
  ``1/sqrt(2 d)``, d = sketch width; see :class:`CountSketch`).
- ``update_norm_mean/max/min``: statistics of ``||u_i||`` (raw, before clipping) over accepted updates.
- ``num_clipped``: accepted updates with ``||u_i|| > S`` (scaled down to norm S).
- ``num_excluded``: whole updates the rule left out (Krum n-1, Multi-Krum n-m, Bulyan n-theta, K-norm k).
- ``num_trimmed_per_coord``: values per coordinate a coordinate-wise rule left out (trimmed mean 2m,
  median n-1 or n-2, Bulyan 2f among the selected).
- ``num_rejected``: updates refused by validation (non-finite, over the norm ceiling, wrong shape).
- ``rule_update_norm``: ``||rule output||``; ``aggregate_update_norm``: ``||g||`` (with noise).
- ``max_weight_share``: ``max_i w_i / Σ_i w_i`` over the aggregated updates (``1/n`` unweighted): how far one
  client's clipped update can move a mean, the sensitivity factor of the DP accountant (:mod:`fedcore.privacy`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch


def weight_divergence(updates: torch.Tensor, scales: torch.Tensor, step: torch.Tensor) -> float:
    """Exact ``(1/n) Σ ||u_i - g||`` where row i of ``updates`` holds ``scales[i] * u_i`` (the update after
    clipping with factor ``scales[i] > 0``; 1 for an unclipped update) and ``step`` is g.

    ``||u_i - g|| = ||c_i - s_i g|| / s_i`` is computed row by row with one ``[P]`` temporary, so the raw
    updates never need to be kept next to the clipped ones.
    """
    n = int(updates.shape[0])
    if n == 0:
        raise ValueError("no updates")
    tmp = torch.empty_like(step)
    total = 0.0
    for i in range(n):
        s = float(scales[i])
        torch.sub(updates[i], step, alpha=s, out=tmp)
        total += float(torch.linalg.vector_norm(tmp)) / s
    return total / n


SKETCH_SCRATCH_ELEMS = 1 << 18
SKETCH_MIN_ROWS = 64


@functools.lru_cache(maxsize=4)
def _signs(num_params: int, seed: int) -> torch.Tensor:
    """The sketch's ±1 signs (float32 [P]) of ``seed``: drawn once per model size and seed, not once per round (a
    server makes a sketch every round; a 940k-parameter model's signs cost milliseconds)."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (num_params,), generator=gen, dtype=torch.int8).to(torch.float32)
    return signs.mul_(2.0).sub_(1.0)


class CountSketch:
    """Linear sketch ``S: R^P -> R^d`` with ``E ||S x||^2 = ||x||^2`` (random signs, buckets j mod d).

    Coordinate j is multiplied by a fixed random sign s_j (seeded) and added into bucket ``j mod d``.
    Because S is linear, ``||S u_i - S g||`` estimates ``||u_i - g||`` from the d-vector ``S u_i`` alone,
    which lets streaming FedAvg report w_div without keeping the updates. For an x whose energy is spread
    over the buckets, ``Var ||Sx||^2 ≈ 2 ||x||^4 / d``, i.e. the norm has relative standard error about
    ``1/sqrt(2 d)`` (1.1 % for d = 4093); a prime d avoids aliasing with power-of-two layer widths.
    Memory: P float32 signs, a cache-sized scratch, and d float64 per sketched vector; cost: one pass.
    """

    def __init__(self, num_params: int, dim: int, seed: int = 0) -> None:
        if dim < 1:
            raise ValueError(f"sketch_dim: must be >= 1, got {dim}")
        self.num_params = num_params
        self.dim = dim
        self.signs = _signs(num_params, seed)  # shared, read only
        self._full = (num_params // dim) * dim
        # Rows of d coordinates processed per step: the scratch stays cache-sized (a [P] temporary halves
        # the throughput), and >= 64 rows keeps torch's column-sum kernel on its fast path.
        self.rows_per_step = max(SKETCH_MIN_ROWS, SKETCH_SCRATCH_ELEMS // dim)
        self._tmp = torch.empty(min(self._full, self.rows_per_step * dim), dtype=torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sketch of ``x`` ([P]) as float64 [d] (:meth:`rows` of the one row)."""
        if x.shape != (self.num_params,):
            raise ValueError(f"expected shape ({self.num_params},), got {tuple(x.shape)}")
        return self.rows(x.unsqueeze(0))[0]

    def rows(self, x: torch.Tensor, out: npt.NDArray[np.float64] | None = None) -> torch.Tensor:
        """Sketches of the rows of ``x`` ([n, P]) as float64 [n, d]; a block of small updates at numpy's per-call
        cost once. numpy does the arithmetic (single-threaded, no OpenMP worker left spinning next to the caller's
        threads; about 1.5x torch's speed on one core): per step of ``rows_per_step`` rows of d coordinates, the
        signed values are summed per bucket in float32, and the steps are added in order in float64 -- the same
        operations in the same order for every row whatever ``n``, so a row's sketch does not depend on the block
        it came in. Scratch: the cache-sized one when ``n`` rows of a step fit it, else a temporary.

        ``out``: a C-contiguous float64 ``[n, d]`` array the sketches are written into (and returned as a tensor
        sharing it), e.g. rows of a caller's store: no array per call (streaming FedAvg keeps each update's sketch
        until the round's end)."""
        if x.dim() != 2 or x.shape[1] != self.num_params:
            raise ValueError(f"expected shape (n, {self.num_params}), got {tuple(x.shape)}")
        n, full, d = int(x.shape[0]), self._full, self.dim
        xn = x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
        signs, scratch = self.signs.numpy(), self._tmp.numpy()
        if out is None:
            out = np.zeros((n, d), dtype=np.float64)
        elif out.shape != (n, d) or out.dtype != np.float64 or not out.flags.c_contiguous:
            raise ValueError(f"out: expected a C-contiguous float64 array of shape ({n}, {d}), got {out.dtype} "
                             f"{out.shape}")
        else:
            out.fill(0.0)  # the same start as np.zeros: the adds below are the same operations
        step = self.rows_per_step * d
        for start in range(0, full, step):
            stop = min(start + step, full)
            size = n * (stop - start)
            tmp = scratch[:size] if size <= scratch.size else np.empty(size, dtype=np.float32)
            t = tmp.reshape(n, stop - start)
            np.multiply(xn[:, start:stop], signs[start:stop], out=t)
            # One row: numpy's 2-D column sum is ~1.5x its 3-D one; the same additions in the same order.
            sums = t.reshape(-1, d).sum(axis=0) if n == 1 else t.reshape(n, -1, d).sum(axis=1)
            np.add(out, sums, out=out)
        tail = self.num_params - full
        if tail:
            out[:, :tail] += xn[:, full:] * signs[full:]
        return torch.from_numpy(out)


def sketched_weight_divergence(sketches: torch.Tensor, step_sketch: torch.Tensor,
                               order: Sequence[int] | None = None) -> float:
    """Estimate of ``(1/n) Σ ||u_i - g||`` from ``S u_i`` (rows of ``[n, d]``) and ``S g``.

    ``order``: the rows' canonical order (e.g. by sender), when they are stored in another (arrival): each row's
    estimate is the same wherever the row is, and the mean is taken over them in ``order`` -- the value the rows
    put in that order would give, without moving them."""
    norms = torch.linalg.vector_norm(sketches - step_sketch.unsqueeze(0), dim=1)
    if order is not None:
        norms = norms[torch.tensor(list(order), dtype=torch.long)]
    return float(norms.mean())


def norm_stats(norms: torch.Tensor) -> dict[str, float]:
    """``update_norm_mean/max/min`` of the given (raw) update norms; NaN when there are none."""
    if norms.numel() == 0:
        return {"update_norm_mean": math.nan, "update_norm_max": math.nan, "update_norm_min": math.nan}
    n64 = norms.to(torch.float64)
    return {
        "update_norm_mean": float(n64.mean()),
        "update_norm_max": float(n64.max()),
        "update_norm_min": float(n64.min()),
    }
