"""Simulated attacks: data poisoning by attacker clients (label flipping, backdoor)."""

from fedcore.attacks.poisoning import (
    DISTFL_FLIP_PAIRS,
    LINDT_BACKDOOR_PAIRS,
    AttackConfig,
    AttackError,
    BackdoorBatches,
    attacker_local_epochs,
    backdoor_batches,
    backdoor_set,
    clean_batches,
    flip_labels,
    label_mapping,
    poison_client_data,
    poisoned_batches,
    target_mapping,
)

__all__ = [
    "DISTFL_FLIP_PAIRS",
    "LINDT_BACKDOOR_PAIRS",
    "AttackConfig",
    "AttackError",
    "BackdoorBatches",
    "attacker_local_epochs",
    "backdoor_batches",
    "backdoor_set",
    "clean_batches",
    "flip_labels",
    "label_mapping",
    "poison_client_data",
    "poisoned_batches",
    "target_mapping",
]
