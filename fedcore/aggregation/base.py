"""The aggregator interface the coordinator uses, and its two implementations.

- :class:`StreamingFedAvg`: weighted (or plain) FedAvg as an exact fixed-point running sum
  (:mod:`fedcore.aggregation.fixedpoint`), memory independent of K, with server-side DP (clip each update as
  it arrives, add noise at the end) and a CountSketch estimate of w_div.
- :class:`BufferedAggregator`: every other rule (and FedAvg with ``exact_metrics``): updates are validated,
  clipped and written as they arrive into ONE preallocated ``[K, P]`` float32 buffer; ``finalize`` puts the
  filled rows in canonical order and runs the rule, the noise and the exact metrics over them.

Arrival order: every update is added with a ``key`` naming its sender (the coordinator passes the client id;
keys are unique within a round). The result of ``finalize`` -- new global model and metrics -- is bit-for-bit
the same for any order of the same adds: streaming FedAvg sums exactly (integer arithmetic) and reduces its
per-update statistics in key order; the buffered aggregator sorts its rows by key before the rule runs.
Updates with equal keys (e.g. the default ``""``) keep the order in which they were added.

Both validate each update in :meth:`add` (shape, finite values, norm ceiling, weight) and raise
:class:`ValueError` with the reason for a bad one, which is then counted in ``num_rejected`` and never
averaged in; :meth:`check` is the same validation as a dry run.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from fedcore.aggregation import fixedpoint
from fedcore.aggregation.config import AggregationConfig, AggregationResult, TooFewUpdatesError
from fedcore.aggregation.fixedpoint import FixedPointSum
from fedcore.aggregation.memory import check_memory, uses_buffer
from fedcore.aggregation.metrics import CountSketch, norm_stats, sketched_weight_divergence
from fedcore.aggregation.pipeline import Pipeline
from fedcore.aggregation.rules import Rule
from fedcore.aggregation.steps import Clip, GaussianNoise, Validate, adaptive_metrics, scaled_noise

__all__ = [
    "AggregationConfig",
    "AggregationResult",
    "Aggregator",
    "BufferedAggregator",
    "StreamingFedAvg",
    "TooFewUpdatesError",
    "make_aggregator",
]


class Aggregator(Protocol):
    def check(self, update: torch.Tensor) -> str | None:
        """Why ``update`` would be rejected by :meth:`add`, or None if it is acceptable (nothing is recorded)."""
        ...

    def add(self, update: torch.Tensor, weight: float, key: str = "") -> None:
        """Take one client's flattened update u_i (shape [P]) with its weight n_i, sent by ``key``.

        ``key`` identifies the sender (unique within a round); the result does not depend on the order of
        the adds. Raises :class:`ValueError` with the reason (and counts it as rejected) for a bad update or
        weight.
        """
        ...

    @property
    def count(self) -> int: ...

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        """New global model w^r (shape [P]) from w^{r-1} and the updates added so far, with the round's metrics.

        Raises :class:`TooFewUpdatesError` (a ValueError) if the rule cannot work with the updates received.
        """
        ...


def _weight(weight: float, weighted: bool) -> tuple[float, str | None]:
    if not weighted:
        return 1.0, None
    w = float(weight)
    if not (math.isfinite(w) and w > 0):
        return w, f"update weight must be a finite number > 0, got {w}"
    return w, None


@dataclass(frozen=True)
class _Received:
    """What streaming FedAvg keeps of one accepted update besides its d-float sketch: a few numbers."""

    key: str
    seq: int
    norm: float
    weight: float


class StreamingFedAvg:
    """Exact running (weighted) sum of clipped updates: memory is a few [P] vectors whatever the number of
    clients, and the result is bit-for-bit independent of the order in which updates arrive.

    ``finalize`` returns ``w^{r-1} + Σ w_i Clip(u_i, S) / Σ w_i + N(0, σ² I)`` (LINDT Eq. 4 when unweighted).
    w_div and delta are *estimates* from a CountSketch of each raw update when ``sketch_dim > 0``
    (``w_div_exact = 0``); with ``sketch_dim = 0`` they are not reported at all.

    The sum ``Σ w_i s_i u_i`` (s_i the clip scale) is kept in 128-bit fixed point
    (:class:`~fedcore.aggregation.fixedpoint.FixedPointSum`, two int64 per coordinate): each term
    ``c = float64(u) * (w_i * s_i)`` is rounded once to the resolution ``2^-63`` and added exactly.

    - Range: every coordinate of every weighted, clipped update must satisfy ``|w_i s_i u_ij| <= 2^30``
      (about 1.07e9); an update beyond it is refused with a ValueError and counted as rejected (checked
      from the update's norm, and from its max-abs only when the norm alone does not settle it). The weighted
      sum then stays within ``±2^46``. At most ``2^16`` (65536) updates per round.
    - Resolution ``2^-63`` (about 1.08e-19) per term; the weight total ``Σ w_i`` is a correctly rounded
      ``math.fsum`` (exact for sample counts). The mean ``(sum / Σ w_i)`` is formed in float64 from the
      exact integers and rounded to float32 once, so it agrees with a float64 reference to float32 rounding.
    - Order: the integer sums are order-independent; the norm statistics and the sketches are reduced in key
      order (ties in arrival order).
    - Blocks: a small model's updates are validated and range-checked as they arrive (``add`` refuses a bad one
      at once) and copied into a block of :func:`~fedcore.aggregation.fixedpoint.block_rows` rows (one chunk); a
      full block, the block once all but one of the round's ``expected`` updates are in (the close then sums the last
      row only), and the last one at ``finalize``, is summed and sketched at once
      (:meth:`FixedPointSum.add_rows`, :meth:`CountSketch.rows`): bit-identical to adding them one by one, for
      numpy's per-call cost once per block. A model of more than half a chunk (32,768 parameters) is added as
      it arrives.
    """

    def __init__(
        self,
        num_params: int,
        weighted: bool = True,
        *,
        clip_norm: float | None = None,
        noise_sigma: float = 0.0,
        max_update_norm: float = math.inf,
        sketch_dim: int = 0,
        sketch_seed: int = 0,
        workers: int | None = None,
        expected: int = 0,
        noise_multiplier: float | None = None,
    ) -> None:
        if noise_multiplier is not None and clip_norm is None:
            raise ValueError("noise_multiplier: needs a clip norm (the noise is a multiple of the sensitivity)")
        self._sum = FixedPointSum(num_params, workers)
        self._weighted = weighted
        self._validate = Validate(num_params, max_update_norm)
        self._clip = Clip(clip_norm)
        self._noise = GaussianNoise(noise_sigma)
        # Adaptive clipping: the noise std is this times the round's sensitivity (see make_aggregator).
        self._noise_multiplier = noise_multiplier
        self._sketch = CountSketch(num_params, sketch_dim, sketch_seed) if sketch_dim > 0 else None
        self._received: list[_Received] = []
        # S u_i by seq, written in place as blocks are flushed: one [capacity, d] float64 array, grown by doubling
        # (``expected``, the round's K, sizes it: it is never copied then), untouched pages until written.
        self._sketches = np.empty((max(1, expected) if self._sketch is not None else 0, sketch_dim))
        self._sketched = 0
        rows = fixedpoint.block_rows(num_params)
        self._block = torch.empty(rows, num_params, dtype=torch.float32) if rows > 1 else None
        self._pending: list[float] = []  # the multipliers of the block's filled rows
        self._expected = expected
        self._num_clipped = 0
        self._rejected: list[str] = []

    @property
    def count(self) -> int:
        return len(self._received)

    @property
    def accumulators(self) -> tuple[torch.Tensor, ...]:
        """The ``[P]`` int64 accumulators of the exact sum (their size does not depend on the count)."""
        self._flush()
        return self._sum.hi, self._sum.lo

    def check(self, update: torch.Tensor) -> str | None:
        return self._validate.check(update)[1]

    def _reject(self, reason: str) -> None:
        self._rejected.append(reason)
        raise ValueError(reason)

    def add(self, update: torch.Tensor, weight: float, key: str = "") -> None:
        if self.count >= fixedpoint.MAX_UPDATES:
            self._reject(f"streaming FedAvg sums at most {fixedpoint.MAX_UPDATES} updates per round exactly")
        w, reason = _weight(weight, self._weighted)
        if reason is not None:
            self._reject(reason)
        norm, reason = self._validate.check(update)
        if reason is not None:
            self._reject(reason)
        u = update.detach().to(device="cpu", dtype=torch.float32)
        scale = self._clip.scale(norm)
        multiplier = w * scale
        # max|u_j| <= ||u||: the norm settles the range check unless the update is near the limit (the margin
        # covers the rounding of the float32 norm); only then is the max-abs computed (one more pass).
        if multiplier * norm * (1.0 + 2.0**-10) > fixedpoint.ADD_LIMIT:
            lo, hi = torch.aminmax(u)
            reason = FixedPointSum.range_error(max(-float(lo), float(hi)), multiplier)
            if reason is not None:
                self._reject(reason)
        self._num_clipped += scale < 1.0
        self._received.append(_Received(key, len(self._received), norm, w))
        if self._block is None:
            self._sum.add(u, multiplier)
            self._sketch_rows(u.unsqueeze(0))
            return
        self._block[len(self._pending)].copy_(u)
        self._pending.append(multiplier)
        # A full block is summed now; so is the block once all but one of the round's expected updates are in: the
        # round's close (which waits for the last one) then sums one row, not the whole block.
        if len(self._pending) == self._block.shape[0] or len(self._received) == self._expected - 1:
            self._flush()

    def _flush(self) -> None:
        """Sum and sketch the block's filled rows (nothing when it is empty)."""
        n = len(self._pending)
        if n == 0 or self._block is None:
            return
        rows = self._block[:n]
        self._sum.add_rows(rows, self._pending)
        self._sketch_rows(rows)
        self._pending = []

    def _sketch_rows(self, rows: torch.Tensor) -> None:
        """Sketch ``rows`` (the next updates by seq) into the store."""
        if self._sketch is None:
            return
        start, n = self._sketched, int(rows.shape[0])
        if start + n > self._sketches.shape[0]:
            grown = np.empty((max(2 * self._sketches.shape[0], start + n), self._sketches.shape[1]))
            grown[:start] = self._sketches[:start]
            self._sketches = grown
        self._sketch.rows(rows, out=self._sketches[start : start + n])
        self._sketched = start + n

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        if self.count == 0:
            raise TooFewUpdatesError("no updates to aggregate")
        self._flush()
        received = sorted(self._received, key=lambda r: (r.key, r.seq))
        total_weight = math.fsum(r.weight for r in received)  # correctly rounded: order-independent
        mean = self._sum.value(total_weight)
        share = max(r.weight for r in received) / total_weight
        noise_step = self._noise
        if self._noise_multiplier is not None and self._clip.max_norm is not None:
            noise_step = scaled_noise(self._noise_multiplier, self._clip.max_norm, share)
        step, noise = noise_step(mean, generator)
        metrics: dict[str, float] = {
            "num_updates": float(self.count),
            "num_rejected": float(len(self._rejected)),
            "num_clipped": float(self._num_clipped),
            "num_excluded": 0.0,
            "num_trimmed_per_coord": 0.0,
            **norm_stats(torch.tensor([r.norm for r in received], dtype=torch.float64)),
            "rule_update_norm": float(torch.linalg.vector_norm(mean)),
            "aggregate_update_norm": float(torch.linalg.vector_norm(step)),
            "noise_norm": noise.noise_norm,
            "max_weight_share": share,
        }
        if self._noise_multiplier is not None and self._clip.max_norm is not None:
            metrics.update(adaptive_metrics(self._clip.max_norm, self.count, self._num_clipped, noise_step.sigma))
        if self._sketch is not None:
            # The rows stay in arrival order; the mean is taken in key order (the same value as stacking them so).
            sketches = torch.from_numpy(self._sketches[: self._sketched])
            w_div = sketched_weight_divergence(sketches, self._sketch(step), [r.seq for r in received])
            metrics.update({"w_div": w_div, "delta": w_div - noise.noise_norm, "w_div_exact": 0.0})
        return AggregationResult(global_flat + step.to(global_flat.dtype), metrics, rejected=list(self._rejected))


class BufferedAggregator:
    """Any rule over ONE preallocated ``[K, P]`` float32 buffer that updates are validated, clipped and
    written into as they arrive (no stacking copy); exact metrics. At most ``k`` updates can be added.

    ``finalize`` first permutes the filled rows, in place, into canonical order -- sorted by key, equal keys
    in the order they were added -- together with their weights, norms and clip scales (cycle-following
    with one ``[P]`` temporary row, never a second ``[K, P]`` buffer), so every rule sees the same rows in
    the same order whatever the arrival order and its result is bit-for-bit reproducible.
    ``result.selected`` still names positions in order of acceptance.
    """

    def __init__(self, config: AggregationConfig, num_params: int, k: int,
                 noise_multiplier: float | None = None) -> None:
        if k < 1:
            raise ValueError(f"k: must be >= 1, got {k}")
        if noise_multiplier is not None and config.clip_norm is None:
            raise ValueError("noise_multiplier: needs a clip norm (the noise is a multiple of the sensitivity)")
        self._config = config
        self._k = k
        self._pipeline = Pipeline.from_config(config, num_params, noise_multiplier)
        # torch.empty does not touch the pages: the process's memory grows as rows are written.
        self._buffer = torch.empty(k, num_params, dtype=torch.float32)
        self._weights = torch.zeros(k, dtype=torch.float64)
        self._norms = torch.zeros(k, dtype=torch.float64)
        self._scales = torch.ones(k, dtype=torch.float64)
        self._keys: list[str] = []
        self._accepted: list[int] = []  # acceptance position of each buffer row
        self._count = 0
        self._rejected: list[str] = []

    @property
    def count(self) -> int:
        return self._count

    @property
    def capacity(self) -> int:
        return self._k

    @property
    def rows(self) -> torch.Tensor:
        """A view of the ``[count, P]`` filled rows of the buffer (the clipped updates; in canonical order
        after :meth:`finalize`, in order of acceptance before); do not modify it."""
        return self._buffer[: self._count]

    @property
    def keys(self) -> list[str]:
        """The key of each filled row, in the rows' current order."""
        return list(self._keys)

    def check(self, update: torch.Tensor) -> str | None:
        return self._pipeline.validate.check(update)[1]

    def _reject(self, reason: str) -> None:
        self._rejected.append(reason)
        raise ValueError(reason)

    def add(self, update: torch.Tensor, weight: float, key: str = "") -> None:
        if self._count >= self._k:
            raise ValueError(f"the aggregator already holds its K={self._k} updates")
        w, reason = _weight(weight, self._config.weighted)
        if reason is not None:
            self._reject(reason)
        norm, reason = self._pipeline.validate.check(update)
        if reason is not None:
            self._reject(reason)
        i = self._count
        row = self._buffer[i]
        row.copy_(update)
        self._scales[i] = self._pipeline.clip.apply_(row, norm)
        self._norms[i] = norm
        self._weights[i] = w
        self._keys.append(key)
        self._accepted.append(i)
        self._count += 1

    def replace_row(self, i: int, update: torch.Tensor) -> None:
        """Put ``update`` in filled row ``i`` instead of what it holds (the full-knowledge test harness's crafted
        row), validated and clipped like an upload; its weight and key stay. ValueError for a bad update."""
        if not 0 <= i < self._count:
            raise ValueError(f"row {i} is not a filled row (0..{self._count - 1})")
        norm, reason = self._pipeline.validate.check(update)
        if reason is not None:
            raise ValueError(reason)
        row = self._buffer[i]
        row.copy_(update)
        self._scales[i] = self._pipeline.clip.apply_(row, norm)
        self._norms[i] = norm

    def use_rule(self, rule: Rule) -> None:
        """Aggregate this round with ``rule`` instead of the configured one (the simulation harness's oracle
        trimmed mean); ValueError when it cannot work with the rows held."""
        rule.check(self._count)
        self._pipeline = dataclasses.replace(self._pipeline, rule=rule)

    @property
    def rule(self) -> Rule:
        return self._pipeline.rule

    def canonical_order(self) -> None:
        """Put the filled rows in canonical (key) order now; :meth:`finalize` does it anyway."""
        self._canonical_order()

    def _canonical_order(self) -> None:
        """Permute the filled rows (and their per-row data) in place into key order (stable)."""
        n = self._count
        perm = sorted(range(n), key=self._keys.__getitem__)  # new row j = old row perm[j]
        if perm == list(range(n)):
            return
        permute_rows_(self._buffer, perm)
        idx = torch.tensor(perm, dtype=torch.long)
        for t in (self._weights, self._norms, self._scales):
            t[:n] = t[:n][idx]
        self._keys = [self._keys[i] for i in perm]
        self._accepted = [self._accepted[i] for i in perm]

    def finalize(self, global_flat: torch.Tensor, generator: torch.Generator | None = None) -> AggregationResult:
        n = self._count
        self._canonical_order()
        result, _ = self._pipeline.finish(
            self._buffer[:n], self._weights[:n], self._norms[:n], self._scales[:n], global_flat, generator,
            num_rejected=len(self._rejected), k=self._k,
        )
        result.rejected = list(self._rejected)
        if result.selected is not None:
            result.selected = tuple(sorted(self._accepted[j] for j in result.selected))
        return result


def permute_rows_(buffer: torch.Tensor, perm: list[int]) -> None:
    """Reorder the first ``len(perm)`` rows of ``buffer`` in place so that new row j is old row ``perm[j]``.

    Follows each cycle of the permutation with one temporary row: ``len(perm) + cycles`` row copies and
    ``O(P)`` extra memory (never a second copy of the rows).
    """
    n = len(perm)
    if sorted(perm) != list(range(n)):
        raise ValueError(f"not a permutation of range({n}): {perm}")
    done = [False] * n
    tmp: torch.Tensor | None = None
    for start in range(n):
        if done[start] or perm[start] == start:
            done[start] = True
            continue
        if tmp is None:
            tmp = torch.empty_like(buffer[0])
        tmp.copy_(buffer[start])
        j = start
        while perm[j] != start:
            buffer[j].copy_(buffer[perm[j]])
            done[j] = True
            j = perm[j]
        buffer[j].copy_(tmp)
        done[j] = True


def make_aggregator(config: AggregationConfig, num_params: int, k: int, *,
                    noise_multiplier: float | None = None) -> Aggregator:
    """The aggregator for ``config`` for rounds of up to ``k`` updates of ``num_params`` float32 values.

    ``noise_multiplier`` (adaptive clipping, :mod:`fedcore.adaptive_clip`): None (the default) adds
    ``config.noise_sigma`` as configured; a number z ≥ 0 adds noise of std ``z · clip_norm · max_weight_share``
    instead, the round's own sensitivity times z (the share is known when the round closes), and the round's
    metrics then carry ``clip_norm``, ``num_unclipped`` and ``noise_sigma`` (the std added). It needs
    ``config.clip_norm`` and ``config.noise_sigma = 0``.

    Validates ``config`` against ``k`` and, when ``config.memory_budget_bytes > 0``, checks the memory
    arithmetic against it (:func:`fedcore.aggregation.memory.check_memory`). FedAvg without
    ``exact_metrics`` streams (at most :data:`~fedcore.aggregation.fixedpoint.MAX_UPDATES` updates); every
    other configuration uses a ``[k, num_params]`` buffer.
    """
    config.validate(k)
    if noise_multiplier is not None:
        if config.clip_norm is None or config.noise_sigma != 0.0:
            raise ValueError("noise_multiplier: needs clip_norm set and noise_sigma = 0 (the noise is a multiple of "
                             "the sensitivity)")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"noise_multiplier: must be a finite number >= 0, got {noise_multiplier}")
    if config.memory_budget_bytes > 0:
        check_memory(config, k, num_params, config.memory_budget_bytes)
    if not uses_buffer(config):
        if k > fixedpoint.MAX_UPDATES:
            raise ValueError(f"k: streaming FedAvg sums at most {fixedpoint.MAX_UPDATES} updates per round "
                             f"exactly, got k={k} (set exact_metrics or lower K)")
        return StreamingFedAvg(
            num_params,
            weighted=config.weighted,
            clip_norm=config.clip_norm,
            noise_sigma=config.noise_sigma,
            max_update_norm=config.max_update_norm,
            sketch_dim=config.sketch_dim,
            sketch_seed=config.sketch_seed,
            expected=k,
            noise_multiplier=noise_multiplier,
        )
    return BufferedAggregator(config, num_params, k, noise_multiplier)
