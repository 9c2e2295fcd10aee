"""The trainers' registry (``recovery.method``, a client's ``trainer``), torch-free.

Each built-in trainer is declared here with its one line and its options' dataclass; the module that implements it
registers its factory (:meth:`fedcore.registry.Registry.add`) and is imported when the trainer is first made, so
that reading a configuration and listing the trainers import no torch. A new trainer is one new module that
registers itself and one declaration here (docs/extending.md), or, from outside fedcore, one ``TRAINERS.add``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedcore.registry import Registry

# A trainer's factory: its options table (None: the defaults) -> a fedcore.train.trainers.Trainer (typed loosely
# here, so that this module imports nothing of the implementation; fedcore.train.trainers.make_trainer is typed).
TrainerFactory = Callable[[Mapping[str, Any] | None], Any]

TRAINERS: Registry[TrainerFactory] = Registry("trainer", ValueError)

_TRAINERS, _PERSONAL, _LINDT, _KD = ("fedcore.train.trainers", "fedcore.train.personal", "fedcore.train.lindt",
                                     "fedcore.train.kd")
TRAINERS.declare("vanilla", _TRAINERS, summary="local SGD (FedProx with prox_mu > 0), no recovery method")
TRAINERS.declare("flguard", _TRAINERS, options=f"{_TRAINERS}:FlGuardConfig",
                 summary="local SGD, with FL-GUARD's model adaptation while recovery is on (the default)")
TRAINERS.declare("noop", _TRAINERS, summary="returns the received model at once (benchmarks, protocol tests)")
# The personalization baselines (FL-GUARD §5.2–5.4: Ditto, APFL, fine-tuning FT, classifier fine-tuning FB).
TRAINERS.declare("ditto", _PERSONAL, options=f"{_PERSONAL}:DittoConfig",
                 summary="Ditto, a personal model trained toward the global one with weight λ")
TRAINERS.declare("apfl", _PERSONAL, options=f"{_PERSONAL}:ApflConfig",
                 summary="APFL, a personal model mixed with the global one by a learned α")
TRAINERS.declare("ft", _PERSONAL, options=f"{_PERSONAL}:FineTuneConfig",
                 summary="FT, fine-tunes the whole received global model")
TRAINERS.declare("fb", _PERSONAL, options=f"{_PERSONAL}:FineTuneConfig",
                 summary="FB, fine-tunes only the top layer (the classifier) of the received model")
TRAINERS.declare("lindt", _LINDT, options=f"{_LINDT}:LindtConfig", summary="LINDT's layer-wise intertwined dual model")
# The knowledge-distillation trainers (FedNTD, MOON, HYDRA-FL); no recovery method.
TRAINERS.declare("fedntd", _KD, options=f"{_KD}:FedNtdConfig",
                 summary="FedNTD, cross-entropy plus not-true distillation")
TRAINERS.declare("moon", _KD, options=f"{_KD}:MoonConfig", summary="MOON, cross-entropy plus a model-contrastive loss")
TRAINERS.declare("hydra", _KD, options=f"{_KD}:HydraConfig",
                 summary="HYDRA-FL, cross-entropy plus distillation at the final and a shallow head")


@dataclass
class RecoveryConfig:
    """The clients' recovery (personalization) method, announced at join (SPEC §7): a trainer registered on the
    clients (:data:`TRAINERS`; the trainers are listed under "Plugins" below) and its
    options, which the trainer validates. A client that names its own ``trainer`` uses that instead."""

    # The recovery trainer by registered name (default flguard: FL-GUARD model adaptation; vanilla: none).
    method: str = "flguard"
    # The method's options (e.g. {l_fb = 2}: flguard's partial-layer adaptation).
    options: dict[str, Any] = field(default_factory=dict)
