"""Simulated attacks: data poisoning (label flipping, backdoor) and model poisoning (model replacement, Stat-Opt,
Dyn-Opt) by attacker clients, and the full-knowledge test harness."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcore.lazy import exported_names, lazy_exports

if TYPE_CHECKING:
    from fedcore.attacks.config import (
        ATTACKS as ATTACKS,
    )
    from fedcore.attacks.config import (
        DISTFL_FLIP_PAIRS as DISTFL_FLIP_PAIRS,
    )
    from fedcore.attacks.config import (
        LINDT_BACKDOOR_PAIRS as LINDT_BACKDOOR_PAIRS,
    )
    from fedcore.attacks.config import (
        AttackConfig as AttackConfig,
    )
    from fedcore.attacks.config import (
        AttackError as AttackError,
    )
    from fedcore.attacks.config import (
        AttackKind as AttackKind,
    )
    from fedcore.attacks.config import (
        BackdoorOptions as BackdoorOptions,
    )
    from fedcore.attacks.config import (
        CraftOptions as CraftOptions,
    )
    from fedcore.attacks.config import (
        DynOptOptions as DynOptOptions,
    )
    from fedcore.attacks.config import (
        LabelFlipOptions as LabelFlipOptions,
    )
    from fedcore.attacks.config import (
        ModelReplacementOptions as ModelReplacementOptions,
    )
    from fedcore.attacks.config import (
        PoisonedUpdate as PoisonedUpdate,
    )
    from fedcore.attacks.config import (
        SimulationHarnessConfig as SimulationHarnessConfig,
    )
    from fedcore.attacks.config import (
        StatOptOptions as StatOptOptions,
    )
    from fedcore.attacks.config import (
        UpdateContext as UpdateContext,
    )
    from fedcore.attacks.model_poisoning import (
        MODEL_KINDS as MODEL_KINDS,
    )
    from fedcore.attacks.model_poisoning import (
        craft_rows as craft_rows,
    )
    from fedcore.attacks.model_poisoning import (
        dyn_opt as dyn_opt,
    )
    from fedcore.attacks.model_poisoning import (
        halving_search as halving_search,
    )
    from fedcore.attacks.model_poisoning import (
        model_replacement as model_replacement,
    )
    from fedcore.attacks.model_poisoning import (
        poison_update as poison_update,
    )
    from fedcore.attacks.model_poisoning import (
        stat_opt as stat_opt,
    )
    from fedcore.attacks.poisoning import (
        BackdoorBatches as BackdoorBatches,
    )
    from fedcore.attacks.poisoning import (
        attacker_local_epochs as attacker_local_epochs,
    )
    from fedcore.attacks.poisoning import (
        backdoor_batches as backdoor_batches,
    )
    from fedcore.attacks.poisoning import (
        backdoor_set as backdoor_set,
    )
    from fedcore.attacks.poisoning import (
        clean_batches as clean_batches,
    )
    from fedcore.attacks.poisoning import (
        flip_labels as flip_labels,
    )
    from fedcore.attacks.poisoning import (
        label_mapping as label_mapping,
    )
    from fedcore.attacks.poisoning import (
        poison_client_data as poison_client_data,
    )
    from fedcore.attacks.poisoning import (
        poisoned_batches as poisoned_batches,
    )
    from fedcore.attacks.poisoning import (
        target_mapping as target_mapping,
    )

# What each submodule gives the package, imported on first use (fedcore.lazy): importing one submodule
# loads no other.
_EXPORTS = {
    "fedcore.attacks.config": (
        "ATTACKS", "DISTFL_FLIP_PAIRS", "LINDT_BACKDOOR_PAIRS", "AttackConfig", "AttackError", "AttackKind",
        "BackdoorOptions", "CraftOptions", "DynOptOptions", "LabelFlipOptions", "ModelReplacementOptions",
        "PoisonedUpdate", "SimulationHarnessConfig", "StatOptOptions", "UpdateContext"
    ),
    "fedcore.attacks.model_poisoning": (
        "MODEL_KINDS", "craft_rows", "dyn_opt", "halving_search", "model_replacement", "poison_update", "stat_opt"
    ),
    "fedcore.attacks.poisoning": (
        "BackdoorBatches", "attacker_local_epochs", "backdoor_batches", "backdoor_set", "clean_batches",
        "flip_labels", "label_mapping", "poison_client_data", "poisoned_batches", "target_mapping"
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = exported_names(_EXPORTS)
