"""The registered names the command lines offer as choices, importable without torch (``--help`` stays fast).

The registries themselves (trainers, aggregation rules, NFL detectors, attacks, datasets, models) live in modules
that import torch; :func:`registered` reads them, and ``tests/unit/test_cli_help.py`` holds the tuples below equal
to it and checks that every name appears in the help of the CLIs that offer it. After registering a new entry,
regenerate the tuples with ``python -m fedcore.names`` (it prints them) and paste them here.
"""

from __future__ import annotations

TRAINERS = ('apfl', 'ditto', 'fb', 'fedntd', 'flguard', 'ft', 'hydra', 'lindt', 'moon', 'noop', 'vanilla')
RULES = ('bulyan', 'fedavg', 'knorm', 'krum', 'median', 'multi_krum', 'trimmed_mean')
DETECTORS = ('beta_hat', 'beta_hat_cusum', 'beta_hat_plateau', 'beta_hat_warmup', 'delta')
ATTACKS = ('none', 'label_flip', 'backdoor', 'model_replacement', 'stat_opt', 'dyn_opt')
DATASETS = ('cifar10', 'har', 'imagefolder', 'mnist', 'npz', 'shakespeare', 'synthetic')
MODELS = ('char_lstm', 'cifar_cnn', 'fedntd_cnn', 'har_cnn', 'hydra_ntd_cnn', 'logreg', 'mlp', 'mlp_bn',
          'mnist_cnn', 'mnist_cnn_bn', 'mnist_mlp', 'moon_cnn', 'resnet18_cifar', 'vgg11_bn')
NFL_MODES = ('detect-and-recover', 'always-recover', 'off')


def registered() -> dict[str, tuple[str, ...]]:
    """The names in the registries now (imports torch)."""
    from fedcore.aggregation.rules import rule_names
    from fedcore.attacks.poisoning import KINDS
    from fedcore.data import available_datasets
    from fedcore.models import available_models
    from fedcore.nfl.config import MODES
    from fedcore.nfl.detectors import DETECTORS as DETECTOR_REGISTRY
    from fedcore.train.trainers import TRAINERS as TRAINER_REGISTRY

    return {"TRAINERS": tuple(TRAINER_REGISTRY.names()), "RULES": tuple(rule_names()),
            "DETECTORS": tuple(DETECTOR_REGISTRY.names()), "ATTACKS": tuple(KINDS),
            "DATASETS": tuple(available_datasets()), "MODELS": tuple(available_models()), "NFL_MODES": tuple(MODES)}


def listed() -> dict[str, tuple[str, ...]]:
    """The tuples of this module."""
    return {"TRAINERS": TRAINERS, "RULES": RULES, "DETECTORS": DETECTORS, "ATTACKS": ATTACKS, "DATASETS": DATASETS,
            "MODELS": MODELS, "NFL_MODES": NFL_MODES}


def one_of(names: tuple[str, ...]) -> str:
    """``a, b or c`` for a help text."""
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


if __name__ == "__main__":
    for key, names in registered().items():
        print(f"{key} = {names!r}")
