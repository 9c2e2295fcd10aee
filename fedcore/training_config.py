"""The ``[training]`` section: the local training hyper-parameters every client uses, and their check.

Apart from :mod:`fedcore.config` because the trainers (:mod:`fedcore.train`) read it and the configuration
validates a method's options through the trainer registry: with the section here, below both, neither imports the
other's importer and no import circle forms. Imports only the leaf :mod:`fedcore.errors`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedcore.errors import require


@dataclass
class TrainingConfig:
    # Local epochs per round on each client.
    local_epochs: int = 1
    # Local mini-batch size.
    batch_size: int = 10
    # Local SGD learning rate of round 1 (see lr_decay).
    learning_rate: float = 0.05
    # SGD momentum.
    momentum: float = 0.0
    # SGD weight decay (L2 penalty).
    weight_decay: float = 0.0
    # Multiply the learning rate by this factor every round (FL-GUARD/LINDT use 0.992).
    lr_decay: float = 1.0
    # Per-step gradient-norm clip on the client; 0 disables it.
    grad_clip_norm: float = 0.0
    # FedProx proximal coefficient mu; 0 is plain local SGD.
    prox_mu: float = 0.0


def validate_training_config(t: TrainingConfig, prefix: str = "training") -> None:
    """Raise :class:`fedcore.errors.ConfigError` naming ``<prefix>.<field>`` for the first unusable field."""
    require(t.local_epochs >= 1, f"{prefix}.local_epochs", f"must be >= 1, got {t.local_epochs}")
    require(t.batch_size >= 1, f"{prefix}.batch_size", f"must be >= 1, got {t.batch_size}")
    require(math.isfinite(t.learning_rate) and t.learning_rate > 0, f"{prefix}.learning_rate",
            f"must be a finite number > 0, got {t.learning_rate}")
    require(0 <= t.momentum < 1, f"{prefix}.momentum", f"must be in [0, 1), got {t.momentum}")
    require(t.weight_decay >= 0, f"{prefix}.weight_decay", f"must be >= 0, got {t.weight_decay}")
    require(0 < t.lr_decay <= 1, f"{prefix}.lr_decay", f"must be in (0, 1], got {t.lr_decay}")
    require(t.grad_clip_norm >= 0, f"{prefix}.grad_clip_norm", f"must be >= 0, got {t.grad_clip_norm}")
    require(t.prox_mu >= 0, f"{prefix}.prox_mu", f"must be >= 0, got {t.prox_mu}")
