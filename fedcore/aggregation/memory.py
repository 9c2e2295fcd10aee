"""Config-time memory arithmetic: refuse a rule/K/P combination that would not fit a budget.

Counted: what the aggregator allocates itself (the ``[K, P]`` float32 update buffer of the buffered rules,
or the exact running sum and sketch of streaming FedAvg), the rule's transient workspace, and the ``[P]``
vectors ``finalize`` creates. Not counted: the caller's own tensors (the update being added, the
previous global model) and the Python/torch baseline of the process.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedcore.aggregation import fixedpoint
from fedcore.aggregation.config import AggregationConfig
from fedcore.aggregation.metrics import SKETCH_MIN_ROWS, SKETCH_SCRATCH_ELEMS
from fedcore.aggregation.rules import build_rule

F32 = 4
F64 = 8
I64 = 8


class MemoryBudgetError(ValueError):
    """The aggregation would need more memory than ``memory_budget_bytes``."""


def _mb(b: int) -> str:
    return f"{b / 1e6:.1f} MB"


@dataclass(frozen=True)
class MemoryItem:
    label: str
    bytes: int
    arithmetic: str

    def describe(self) -> str:
        return f"{self.arithmetic} = {_mb(self.bytes)} for {self.label}"


@dataclass(frozen=True)
class MemoryEstimate:
    rule: str
    streaming: bool
    items: tuple[MemoryItem, ...]

    @property
    def total_bytes(self) -> int:
        return sum(i.bytes for i in self.items)

    def describe(self) -> str:
        mode = "streaming" if self.streaming else "buffered"
        parts = " + ".join(i.describe() for i in self.items)
        return f"{self.rule} ({mode}) needs {parts}; total {_mb(self.total_bytes)}"


def uses_buffer(config: AggregationConfig) -> bool:
    """Whether the aggregator keeps every update in a ``[K, P]`` buffer (all rules but streaming FedAvg)."""
    return not build_rule(config).streamable or config.exact_metrics


def estimate_memory(config: AggregationConfig, k: int, num_params: int) -> MemoryEstimate:
    """Bytes the aggregator for ``config`` needs for rounds of up to ``k`` updates of ``num_params`` floats."""
    rule = build_rule(config)
    p = num_params
    items: list[MemoryItem] = []
    if uses_buffer(config):
        items.append(MemoryItem("the update buffer", k * p * F32, f"K*P*4 = {k}*{p}*4 B"))
        ws, ws_arith = rule.workspace(k, p)
        if ws:
            items.append(MemoryItem(f"{rule.name} workspace", ws, ws_arith))
        items.append(MemoryItem("finalize vectors (rule step, noisy step, new global, w_div temporary)",
                                4 * p * F32, f"4*P*4 = 4*{p}*4 B"))
        return MemoryEstimate(config.rule, False, tuple(items))
    items.append(MemoryItem("the exact running sum (two int64 accumulators)", 2 * p * I64, f"2*P*8 = 2*{p}*8 B"))
    chunk = fixedpoint.scratch_len(p)
    vecs = fixedpoint.SCRATCH_VECTORS
    items.append(MemoryItem("the fixed-point chunk scratch (add workers and finalize)", vecs * chunk * F64,
                            f"{vecs}*{chunk}*8 B"))
    rows = fixedpoint.block_rows(p)
    if rows > 1:
        items.append(MemoryItem("the block of updates summed at once", rows * p * F32, f"B*P*4 = {rows}*{p}*4 B"))
    if config.sketch_dim:
        d = config.sketch_dim
        items.append(MemoryItem("the w_div sketch signs", p * F32, f"P*4 = {p}*4 B"))
        scratch = min(p, max(SKETCH_MIN_ROWS, SKETCH_SCRATCH_ELEMS // d) * d)
        items.append(MemoryItem("the sketch scratch", rows * scratch * F32, f"B*{scratch}*4 B"))
        items.append(MemoryItem("the per-update sketches", k * d * F64, f"K*d*8 = {k}*{d}*8 B"))
    items.append(MemoryItem("finalize vectors (mean step, noisy step, new global)",
                            3 * p * F32, f"3*P*4 = 3*{p}*4 B"))
    return MemoryEstimate(config.rule, True, tuple(items))


def check_memory(config: AggregationConfig, k: int, num_params: int, budget_bytes: int) -> MemoryEstimate:
    """Raise :class:`MemoryBudgetError` (with the arithmetic) if the estimate exceeds ``budget_bytes``."""
    est = estimate_memory(config, k, num_params)
    if est.total_bytes > budget_bytes:
        raise MemoryBudgetError(f"memory_budget_bytes: {est.describe()} > budget {_mb(budget_bytes)} "
                                f"({budget_bytes} B); lower K or P, or pick a streaming rule (fedavg "
                                f"without exact_metrics)")
    return est
