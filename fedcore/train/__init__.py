"""Local training and evaluation on a client's data.

The pieces live in submodules and are re-exported here: the one training loop with its hooks and
:func:`train_local` (plain SGD, optional FedProx term) in :mod:`fedcore.train.loop`, dropout masks from a generator
in :mod:`fedcore.train.dropout`; the trainers (FL-GUARD, LINDT, personalisation, KD) in the other submodules build
on the loop; evaluation and device resolution in :mod:`fedcore.train.evaluation`. The trainers' registry is
:mod:`fedcore.train.registry` (torch-free).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcore.lazy import exported_names, lazy_exports

if TYPE_CHECKING:
    from fedcore.train.dropout import (
        NondeterministicModuleError as NondeterministicModuleError,
    )
    from fedcore.train.dropout import (
        check_deterministic_training as check_deterministic_training,
    )
    from fedcore.train.dropout import (
        deterministic_dropout as deterministic_dropout,
    )
    from fedcore.train.dropout import (
        generator_dropout as generator_dropout,
    )
    from fedcore.train.evaluation import (
        EvalResult as EvalResult,
    )
    from fedcore.train.evaluation import (
        evaluate as evaluate,
    )
    from fedcore.train.evaluation import (
        mode_free as mode_free,
    )
    from fedcore.train.evaluation import (
        resolve_device as resolve_device,
    )
    from fedcore.train.loop import (
        Batches as Batches,
    )
    from fedcore.train.loop import (
        Objective as Objective,
    )
    from fedcore.train.loop import (
        TrainResult as TrainResult,
    )
    from fedcore.train.loop import (
        model_device as model_device,
    )
    from fedcore.train.loop import (
        shuffled_batches as shuffled_batches,
    )
    from fedcore.train.loop import (
        train_local as train_local,
    )

# What each submodule gives the package, imported on first use (fedcore.lazy): importing one submodule
# loads no other.
_EXPORTS = {
    "fedcore.train.dropout": (
        "NondeterministicModuleError", "check_deterministic_training", "deterministic_dropout", "generator_dropout"
    ),
    "fedcore.train.evaluation": ("EvalResult", "evaluate", "mode_free", "resolve_device"),
    "fedcore.train.loop": ("Batches", "Objective", "TrainResult", "model_device", "shuffled_batches", "train_local"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = exported_names(_EXPORTS)
