"""Evaluation metrics of the NFL papers: local/central accuracy, private models, β, attack success rate.

Accuracies are fractions in [0, 1] (as :func:`fedcore.train.evaluation` returns them); β is in the same unit, so
multiply by 100 to compare with the papers' percentage points.

- Local accuracy (LINDT/FL-GUARD "local"): the model a client uses for inference, on that client's test split.
- Central accuracy: the global model on a pooled test set (:func:`pooled_test_set` joins clients' test splits).
- Private model (FL-GUARD §3): a client's stand-alone model trained before it joins FL; Pᵢ is its accuracy on the
  client's test split (:func:`train_private_model`, saved and loaded with :func:`save_private_model`).
- Performance gain (FL-GUARD Eq. 1-2): βᵢ = Vᵢ − Pᵢ; β = Σ αᵢβᵢ with αᵢ = 1/N or αᵢ = nᵢ/n, over all clients
  or over benign ones (:func:`performance_gain`).
- Attack success rate (DistFL Eq. 9): for a source class s with target t, the fraction of test samples of class s
  that the model classifies as t; with several source classes, the mean of their rates (:func:`attack_success_rate`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch
from torch import nn

from fedcore.data.base import ClientData
from fedcore.seeds import PRIVATE_BATCHES, PRIVATE_DROPOUT, PRIVATE_INIT, derive_seed
from fedcore.serialization import load_state, save_state
from fedcore.torch_rng import seeded_global_rng
from fedcore.train import evaluate, train_local
from fedcore.training_config import TrainingConfig

K = TypeVar("K", bound=Hashable)

PRIVATE_MODEL_FILE = "private_model.fgt"


# ---- accuracy ----

def local_accuracy(model: nn.Module, data: ClientData, batch_size: int = 512) -> float:
    """Accuracy of ``model`` on the client's local test split (NaN when the split is empty)."""
    return evaluate(model, data.x_test, data.y_test, batch_size).accuracy


def central_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> float:
    """Accuracy of ``model`` on a pooled test set."""
    return evaluate(model, x, y, batch_size).accuracy


def pooled_test_set(clients: Iterable[ClientData]) -> tuple[torch.Tensor, torch.Tensor]:
    """The union of the clients' test splits (the central test set of a partitioned pool)."""
    xs, ys = [], []
    for c in clients:
        xs.append(c.x_test)
        ys.append(c.y_test)
    if not xs:
        raise ValueError("pooled_test_set needs at least one client")
    return torch.cat(xs), torch.cat(ys)


def predictions(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Arg-max class of every sample, in eval mode (restores the mode)."""
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            out.append(model(x[start : start + batch_size]).argmax(dim=1))
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


# ---- private model ----

def train_private_model(model_factory: Callable[[], nn.Module], data: ClientData, config: TrainingConfig,
                        epochs: int, seed: int, device: torch.device | str = "cpu") -> tuple[
    dict[str, torch.Tensor], float
]:
    """Train a client's stand-alone model from a seeded initialisation; return (state dict on the CPU, Pᵢ).

    ``epochs`` epochs of :func:`fedcore.train.train_local` with ``config``'s batch size, learning rate, momentum,
    weight decay and gradient clip (no FedProx term, no per-round decay), on ``device``. Pᵢ is the accuracy on
    ``data``'s test split.

    Seeds, all derived from ``seed`` (the client's is ``fedcore.seeds.private_seed(federation seed, client id)``):
    the initial weights from ``derive_seed(seed, "private_init")`` — ``model_factory`` runs under
    :data:`fedcore.seeds.GLOBAL_RNG_LOCK` with the global RNG forked and seeded, since ``nn`` initialisers can
    only draw from it — the batches from ``derive_seed(seed, "private_batches")`` and the dropout masks from
    ``derive_seed(seed, "private_dropout")``, both from their own generators. So the result is deterministic in
    ``seed`` also when threads train private models concurrently (on the CPU; GPU kernels may round
    differently), and the global torch RNG is left as it was.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    cfg = dataclasses.replace(config, local_epochs=epochs, prox_mu=0.0)
    with seeded_global_rng(derive_seed(seed, PRIVATE_INIT)):
        model = model_factory()
    model = model.to(device)
    train_local(model, data.x_train, data.y_train, cfg, seed=derive_seed(seed, PRIVATE_BATCHES),
                dropout_seed=derive_seed(seed, PRIVATE_DROPOUT))
    accuracy = local_accuracy(model, data)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    return state, accuracy



def private_model_key(data: ClientData, config: TrainingConfig, epochs: int, seed: int) -> str:
    """What a private model is a function of, besides its architecture: a digest of the client's data (train and
    test tensors, bytes and shapes), the training settings :func:`train_private_model` reads, ``epochs`` and
    ``seed``. A cached Pᵢ is reused only under the same key (and model fingerprint): a client that joins a federation
    with another seed, other data or other training settings trains its private model again."""
    h = hashlib.sha256()
    cfg = dataclasses.replace(config, local_epochs=epochs, prox_mu=0.0)
    h.update(json.dumps({"training": dataclasses.asdict(cfg), "epochs": epochs, "seed": seed,
                         "classes": data.num_classes}, sort_keys=True, default=str).encode())
    for t in (data.x_train, data.y_train, data.x_test, data.y_test):
        c = t.detach().to("cpu").contiguous()
        h.update(f"{c.dtype}{tuple(c.shape)}".encode())
        h.update(c.numpy().tobytes())
    return h.hexdigest()[:32]


def save_private_model(state_dir: str | os.PathLike[str], state: Mapping[str, torch.Tensor], accuracy: float,
                       extra: Mapping[str, object] | None = None) -> Path:
    """Write the private model and Pᵢ to ``state_dir/private_model.fgt`` (fedguard tensor file, no pickle)."""
    path = Path(state_dir) / PRIVATE_MODEL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_state(path, state, {**dict(extra or {}), "accuracy": float(accuracy)})
    return path


def load_private_model(state_dir: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], float] | None:
    """(state dict, Pᵢ) from ``state_dir``, or ``None`` when no private model was saved there."""
    path = Path(state_dir) / PRIVATE_MODEL_FILE
    if not path.exists():
        return None
    state, extra = load_state(path)
    acc = extra.get("accuracy")
    if not isinstance(acc, (int, float)):
        raise ValueError(f"{path}: no private-model accuracy recorded")
    return state, float(acc)


# ---- performance gain β ----

def alpha_weights(clients: Collection[K], sizes: Mapping[K, int] | None = None) -> dict[K, float]:
    """αᵢ = 1/N over ``clients``, or nᵢ/Σn when ``sizes`` (e.g. training-set sizes) are given."""
    if not clients:
        return {}
    if sizes is None:
        return dict.fromkeys(clients, 1.0 / len(clients))
    total = float(sum(sizes[c] for c in clients))
    if total <= 0:
        raise ValueError("client sizes must sum to a positive number")
    return {c: sizes[c] / total for c in clients}


def client_gains(v: Mapping[K, float], p: Mapping[K, float]) -> dict[K, float]:
    """βᵢ = Vᵢ − Pᵢ for every client in ``v`` (each must have a Pᵢ)."""
    missing = [c for c in v if c not in p]
    if missing:
        raise KeyError(f"no private-model performance for clients {missing[:5]}")
    return {c: float(v[c]) - float(p[c]) for c in v}


def overall_gain(betas: Mapping[K, float], alphas: Mapping[K, float]) -> float:
    """β = Σ αᵢβᵢ (NaN for no clients)."""
    if not betas:
        return math.nan
    return float(sum(alphas[c] * b for c, b in betas.items()))


@dataclass(frozen=True)
class GainReport(Generic[K]):
    """βᵢ per client and β four ways: uniform or size-weighted α, over all clients or the benign ones."""

    beta_i: dict[K, float]
    beta: float
    beta_weighted: float
    beta_benign: float
    beta_benign_weighted: float
    num_clients: int
    num_benign: int


def performance_gain(v: Mapping[K, float], p: Mapping[K, float], sizes: Mapping[K, int] | None = None,
                     exclude: Collection[K] = ()) -> GainReport[K]:
    """FL-GUARD Eq. 1-2 over the clients in ``v``; ``exclude`` (e.g. attackers) is left out of the benign β.

    The size-weighted variants use ``sizes`` (αᵢ = nᵢ/n) and are NaN when no sizes are given.
    """
    betas = client_gains(v, p)
    benign = {c: b for c, b in betas.items() if c not in set(exclude)}

    def weighted(bs: Mapping[K, float]) -> float:
        return math.nan if sizes is None or not bs else overall_gain(bs, alpha_weights(list(bs), sizes))

    return GainReport(
        beta_i=betas,
        beta=overall_gain(betas, alpha_weights(list(betas))),
        beta_weighted=weighted(betas),
        beta_benign=overall_gain(benign, alpha_weights(list(benign))),
        beta_benign_weighted=weighted(benign),
        num_clients=len(betas),
        num_benign=len(benign),
    )


# ---- attack success rate ----

def asr_from_predictions(preds: torch.Tensor, labels: torch.Tensor, mapping: Mapping[int, int]) -> float:
    """DistFL Eq. 9: for each source class s (s -> t in ``mapping``, s != t) with test samples,
    |{x of class s : M(x) = t}| / |D_s|; the mean over such source classes (NaN when there are none)."""
    rates = []
    for s, t in mapping.items():
        if int(s) == int(t):
            continue
        mask = labels == int(s)
        n = int(mask.sum())
        if n:
            rates.append(int((preds[mask] == int(t)).sum()) / n)
    return sum(rates) / len(rates) if rates else math.nan


def attack_success_rate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mapping: Mapping[int, int],
                        batch_size: int = 512) -> float:
    """ASR of ``model`` on (x, y) for the attack's source -> target ``mapping`` (DistFL Eq. 9)."""
    sources = torch.tensor([int(s) for s, t in mapping.items() if int(s) != int(t)], dtype=y.dtype)
    mask = torch.isin(y, sources)
    return asr_from_predictions(predictions(model, x[mask], batch_size), y[mask], mapping)
