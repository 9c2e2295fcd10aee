"""Benchmarks: round, transport, memory, persistence, SecAgg, security and Flower comparisons, and their measuring
aids (``cpu_breakdown``, ``spy_profile``, ``scaling_model``, ``soak``). Run each as ``python tools/bench/<name>.py``;
the shared process helpers are :mod:`tools.procstat` and :mod:`tools.runs`."""
