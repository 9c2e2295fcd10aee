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

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcore.lazy import exported_names, lazy_exports

if TYPE_CHECKING:
    from fedcore.aggregation.base import (
        Aggregator as Aggregator,
    )
    from fedcore.aggregation.base import (
        BufferedAggregator as BufferedAggregator,
    )
    from fedcore.aggregation.base import (
        StreamingFedAvg as StreamingFedAvg,
    )
    from fedcore.aggregation.base import (
        make_aggregator as make_aggregator,
    )
    from fedcore.aggregation.config import (
        AggregationConfig as AggregationConfig,
    )
    from fedcore.aggregation.config import (
        AggregationResult as AggregationResult,
    )
    from fedcore.aggregation.config import (
        KNormOptions as KNormOptions,
    )
    from fedcore.aggregation.config import (
        KrumOptions as KrumOptions,
    )
    from fedcore.aggregation.config import (
        MultiKrumOptions as MultiKrumOptions,
    )
    from fedcore.aggregation.config import (
        Rule as Rule,
    )
    from fedcore.aggregation.config import (
        RuleOutput as RuleOutput,
    )
    from fedcore.aggregation.config import (
        TooFewUpdatesError as TooFewUpdatesError,
    )
    from fedcore.aggregation.config import (
        TrimmedMeanOptions as TrimmedMeanOptions,
    )
    from fedcore.aggregation.config import (
        build_rule as build_rule,
    )
    from fedcore.aggregation.config import (
        register_rule as register_rule,
    )
    from fedcore.aggregation.config import (
        rule_names as rule_names,
    )
    from fedcore.aggregation.memory import (
        MemoryBudgetError as MemoryBudgetError,
    )
    from fedcore.aggregation.memory import (
        MemoryEstimate as MemoryEstimate,
    )
    from fedcore.aggregation.memory import (
        check_memory as check_memory,
    )
    from fedcore.aggregation.memory import (
        estimate_memory as estimate_memory,
    )
    from fedcore.aggregation.pipeline import (
        Pipeline as Pipeline,
    )
    from fedcore.aggregation.pipeline import (
        aggregate as aggregate,
    )

# What each submodule gives the package, imported on first use (fedcore.lazy): importing one submodule
# loads no other.
_EXPORTS = {
    "fedcore.aggregation.base": ("Aggregator", "BufferedAggregator", "StreamingFedAvg", "make_aggregator"),
    "fedcore.aggregation.config": (
        "AggregationConfig", "AggregationResult", "KNormOptions", "KrumOptions", "MultiKrumOptions", "Rule",
        "RuleOutput", "TooFewUpdatesError", "TrimmedMeanOptions", "build_rule", "register_rule", "rule_names"
    ),
    "fedcore.aggregation.memory": ("MemoryBudgetError", "MemoryEstimate", "check_memory", "estimate_memory"),
    "fedcore.aggregation.pipeline": ("Pipeline", "aggregate"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = exported_names(_EXPORTS)
