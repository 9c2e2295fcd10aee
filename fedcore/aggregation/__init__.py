"""Server-side aggregation of client updates (see SPEC §5).

The coordinator drives an :class:`Aggregator` per round: it flattens each accepted client's floating-point
update ``u_i = w_i - w^{r-1}`` into a ``[P]`` float32 vector, calls :meth:`Aggregator.add` with the client's
weight (its sample count), and once the round closes calls :meth:`Aggregator.finalize` with the flattened
previous global model to get the new global model and the round's aggregation metrics.
"""

from fedcore.aggregation.base import AggregationConfig, AggregationResult, Aggregator, make_aggregator

__all__ = ["AggregationConfig", "AggregationResult", "Aggregator", "make_aggregator"]
