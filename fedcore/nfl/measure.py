"""What a client measures for NFL detection: its estimated performance gain β̂ᵢ (FL-GUARD Eq. 3).

The NFL vocabulary, one name per quantity (docs/nfl.md):

- ``client_beta_hat`` -- β̂ᵢ, one client's estimate in one round, sent with its update
  (``UpdateReport.beta_hat``): :func:`client_beta_hat` below;
- the round's median of the β̂ᵢ it accepted -- ``RoundReport.beta_hat``, the ``beta_hat`` column of
  ``rounds.jsonl`` and :class:`fedcore.nfl.NflObservation`'s ``beta_hat``;
- the running mean of the last c round medians (FL-GUARD Eq. 5) that the detector thresholds --
  ``NflState.beta_hat_avg`` and ``RoundReport.beta_hat_avg``.

Imports torch (the evaluation); :mod:`fedcore.nfl` itself does not import this module, so the detectors and the
``[nfl]`` section stay torch-free.
"""

from __future__ import annotations

import torch
from torch import nn

from fedcore.train import evaluate, shuffled_batches

# ---- β̂ᵢ (FL-GUARD Eq. 3) ----

def first_batch(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first mini-batch b_iʳ that :func:`fedcore.train.train_local` (and the trainers) see with batch seed
    ``seed`` and no ``batches`` override: the first batch of epoch 0 of ``shuffled_batches(x, y, batch_size,
    seed)`` (a fresh generator, so drawing it does not disturb training). :class:`ValueError` on empty data."""
    if len(y) == 0:
        raise ValueError("first_batch: the client has no training data")
    return next(iter(shuffled_batches(x, y, batch_size, seed)(0)))


def client_beta_hat(inference_model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                    private_accuracy: float) -> float:
    """FL-GUARD's estimated performance gain, Eq. 3: β̂ᵢ = EV(model, b_iʳ) − Pᵢ.

    EV is the accuracy (a fraction, like Pᵢ from :func:`fedcore.metrics.local_accuracy`) of ``inference_model``
    on the round's first training batch b_iʳ (:func:`first_batch`), evaluated before training, in eval mode (no
    dropout, so β̂ᵢ does not depend on masks). ``inference_model`` is the received global model w^{r-1}, or vᵢ
    when the client has an adapted model (§4.3: "β̂ᵢ ← EV(vᵢ, b_iʳ) − Pᵢ")."""
    xb, yb = batch
    if len(yb) == 0:
        raise ValueError("client_beta_hat: empty batch")
    return evaluate(inference_model, xb, yb, batch_size=max(len(yb), 1)).accuracy - float(private_accuracy)
