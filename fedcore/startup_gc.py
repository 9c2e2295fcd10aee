"""Keep the garbage collector off what a process built to start, and make its young passes rarer.

A fedguard process imports torch, numpy, grpc and its own modules and builds its model before it serves or trains:
~200,000 tracked objects that live as long as the process. CPython's cyclic collector walks all of them in every
full (generation 2) pass, and its youngest generation is collected every 700 net allocations of container objects,
which a server allocates several hundred of per client-round (coroutines, futures, protobuf wrappers, dicts).
Measured in a coordinator of 1,000 virtual clients at K = 100 (``tools/bench/bench_rounds.py --cpu-breakdown``, the ``gc
generation`` rows): generations 0 and 1 cost ~28 µs per client-round, and each full pass 55–130 ms of CPU on the event
loop (a pause every few thousand client-rounds, ~20–38 µs per client-round on average).

:func:`freeze_startup_objects` moves every tracked object to the permanent generation (``gc.freeze``: never
walked again), and raises the youngest generation's threshold to
:data:`YOUNG_THRESHOLD` allocations, so most short-lived objects are freed by reference counting before a pass sees
them. Same measurement after it: ~6 µs per client-round for all generations in steady state, no full pass between
start-up and the end. Cyclic garbage is still collected, at most ``YOUNG_THRESHOLD`` container objects later.
No collection runs first: it would cost ~90 ms of CPU per process start (a full pass over the imports) to free what
start-up leaves unreachable, 23 objects in a process that imported torch, ``fedclient`` and ``fedserver``; those stay.

Only the command-line entry points call it (``fedserver``, ``fedclient``, a launcher's host of virtual clients): an
application that embeds a client or a server owns its own process and decides for it.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000  # CPython's default is 700


def freeze_startup_objects() -> int:
    """Freeze every tracked object (never collected, never walked) and set the youngest generation's threshold to
    :data:`YOUNG_THRESHOLD` (the older two keep theirs). Returns the frozen count."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    return gc.get_freeze_count()
