"""What older configurations said and how it is read today: the one place that knows the legacy keys.

Before each plugin owned its options, three sections held them as flat keys beside the plugin's name. They are
still read: each section's ``from_table`` moves them into the named plugin's options table
(:func:`fedcore.registry.fold_flat_options`; a key the plugin does not declare is refused unless it holds its old
default, which meant nothing for that plugin), and :func:`fedcore.config.current_shape` rewrites a stored
configuration (a run dir's ``config.json``) the same way before comparing it with the running one. The NFL settings
that crossed the wire as flat fields before ``NflSettings`` are read in :mod:`fedguard.wire`.

A leaf module: it imports nothing of fedcore, so every section can import its table.
"""

from __future__ import annotations

from typing import Any

# ``[aggregation]``'s flat rule options, with their old defaults, read into ``aggregation.options``.
LEGACY_RULE_OPTIONS: dict[str, Any] = {"trim_m": None, "trim_fraction": None, "krum_f": 1, "multi_krum_m": None,
                                       "knorm_k": 1}

# ``[nfl]``'s flat detector options, with their old defaults, read into ``nfl.detector_options``.
LEGACY_DETECTOR_OPTIONS: dict[str, Any] = {"warmup": 5, "plateau_rounds": 2, "cusum_k": 0.05, "cusum_h": 2.0}

# ``attack``'s (and ``[simulation_harness.attack]``'s) flat kind options, with their old defaults, read into
# ``attack.options``.
LEGACY_ATTACK_OPTIONS: dict[str, Any] = {
    "flip": "reverse", "pairs": (), "target": 0, "poison_per_batch": 3, "batch_size": 10, "boost": 10.0,
    "stat_b": 2.0, "dev_type": "std", "gamma_init": 10.0, "gamma_tol": 1e-5, "estimate_shards": 4,
    "assumed_rule": "trimmed_mean", "assumed_attackers": 2}
