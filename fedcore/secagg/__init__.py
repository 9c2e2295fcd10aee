"""SecAgg+ secure aggregation, gRPC-free: the server learns only the sum of the survivors' updates.

Modules: :mod:`.config` (the section and its validation), :mod:`.graph` (the neighbour graph, the choice of k and t),
:mod:`.shamir` (secret sharing over GF(2^521 - 1)), :mod:`.prg` (AES-CTR masks), :mod:`.crypto` (X25519, HKDF,
sealed shares, signature hooks), :mod:`.protocol` (the client's phases and the server's pure state machine; it
imports torch through :mod:`fedcore.aggregation.fixedpoint`, so import it from there: this package's import stays
light). The unmasked sum is bit-identical to :class:`fedcore.aggregation.fixedpoint.FixedPointSum` over the same
survivors.
"""

from fedcore.secagg.config import SecureAggregationConfig
from fedcore.secagg.graph import GraphParameters, choose_parameters, neighbour_graph

__all__ = ["GraphParameters", "SecureAggregationConfig", "choose_parameters", "neighbour_graph"]
