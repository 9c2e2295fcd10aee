"""Server-side aggregation of client updates (SPEC §5): validate -> clip -> rule -> noise.

The coordinator drives an :class:`Aggregator` per round: it flattens each accepted client's floating-point
update ``u_i = w_i - w^{r-1}`` into a ``[P]`` float32 vector, calls :meth:`Aggregator.add` with the client's
weight (its sample count), and once the round closes calls :meth:`Aggregator.finalize` with the flattened
previous global model to get the new global model and the round's aggregation metrics
(:mod:`fedcore.aggregation.metrics` defines them).

Modules: :mod:`.config` (config, result, errors), :mod:`.steps` (validate, clip, noise), :mod:`.rules`
(rules and their registry), :mod:`.order` (coordinate-wise order statistics), :mod:`.pipeline`
(composition, and :func:`aggregate` as one pure function over a stacked ``[K, P]`` tensor),
:mod:`.metrics` (w_div, Delta, sketch), :mod:`.memory` (memory arithmetic), :mod:`.fixedpoint` (the exact,
order-independent running sum of streaming FedAvg), :mod:`.base` (the incremental aggregators and
:func:`make_aggregator`). Every aggregator's result is bit-for-bit independent of the order in which updates
arrive (see :mod:`.base`).
"""

from fedcore.aggregation.base import (
    Aggregator,
    BufferedAggregator,
    StreamingFedAvg,
    make_aggregator,
)
from fedcore.aggregation.config import AggregationConfig, AggregationResult, TooFewUpdatesError
from fedcore.aggregation.memory import MemoryBudgetError, MemoryEstimate, check_memory, estimate_memory
from fedcore.aggregation.pipeline import Pipeline, aggregate
from fedcore.aggregation.rules import (
    KNormOptions,
    KrumOptions,
    MultiKrumOptions,
    Rule,
    RuleOutput,
    TrimmedMeanOptions,
    build_rule,
    register_rule,
    rule_names,
)

__all__ = [
    "AggregationConfig",
    "AggregationResult",
    "Aggregator",
    "BufferedAggregator",
    "KNormOptions",
    "KrumOptions",
    "MemoryBudgetError",
    "MemoryEstimate",
    "MultiKrumOptions",
    "Pipeline",
    "Rule",
    "RuleOutput",
    "StreamingFedAvg",
    "TooFewUpdatesError",
    "TrimmedMeanOptions",
    "aggregate",
    "build_rule",
    "check_memory",
    "estimate_memory",
    "make_aggregator",
    "register_rule",
    "rule_names",
]
