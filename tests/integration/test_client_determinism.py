"""Client determinism over real gRPC: six in-process ("virtual") clients whose threads train private models and
local updates concurrently give bit-identical results run after run, equal to a sequential computation."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from fedcore.config import TrainingConfig
from fedcore.data import load_client_data
from fedcore.metrics import train_private_model
from fedcore.models import build_model
from fedcore.seeds import private_seed
from tests.integration.helpers import run_federation, server_config

MODEL = "tests.integration.test_client_determinism:dropout_mlp"
FED_SEED = 11
N = 6


def dropout_mlp(in_features: int = 60, num_classes: int = 10, hidden: int = 32) -> nn.Module:
    """A small MLP with dropout: its masks must come from the client's seeded generators."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(hidden, num_classes))


def _federation(tmp_path: Path) -> tuple[dict[str, float], dict[str, float]]:
    """(client -> P_i, client -> round-1 training loss) of one federation of N clients."""
    cfg = server_config(tmp_path, model={"name": MODEL}, rounds={"num_rounds": 2, "clients_per_round": N,
                                                                 "seed": FED_SEED})
    status, summaries = run_federation(cfg, N, timeout=60, linger_s=0.5, model=MODEL, private_epochs=1)
    # The status is a FederationStatus (older servers: a dict).
    outcome = status["outcome"] if isinstance(status, dict) else getattr(status, "outcome", None)
    assert outcome == "completed", status
    private: dict[str, float] = {}
    loss: dict[str, float] = {}
    for s in summaries:
        assert s.finished and s.rounds_trained == 2, s
        values = {h["private_accuracy"] for h in s.history}
        assert len(values) == 1, (s.client_id, values)  # the same P_i in every report of the client
        private[s.client_id] = values.pop()
        loss[s.client_id] = next(h["train_loss"] for h in s.history if h["round"] == 1.0)
    return private, loss


def _sequential_private(fed_seed: int) -> dict[str, float]:
    """P_i of every client computed one after the other in this thread, the way a FedClient does."""
    t = TrainingConfig()
    tc = TrainingConfig(local_epochs=1, batch_size=t.batch_size, learning_rate=t.learning_rate,
                        momentum=t.momentum, weight_decay=t.weight_decay, grad_clip_norm=t.grad_clip_norm)
    out: dict[str, float] = {}
    for i in range(N):
        data = load_client_data("synthetic", i, fed_seed, {})
        _, acc = train_private_model(lambda: build_model(MODEL, {}), data, tc, 1,
                                     seed=private_seed(fed_seed, f"client-{i}"))
        out[f"client-{i}"] = acc
    return out


def test_virtual_clients_are_bit_identical_across_runs(tmp_path: Path) -> None:
    first_p, first_loss = _federation(tmp_path / "a")
    second_p, second_loss = _federation(tmp_path / "b")
    assert set(first_p) == {f"client-{i}" for i in range(N)}
    assert first_p == second_p  # exact float equality, client by client
    assert first_loss == second_loss  # round 1 starts from the same seeded global model everywhere
    assert _sequential_private(FED_SEED) == first_p  # threads changed nothing
    assert _sequential_private(FED_SEED + 1) != first_p  # the federation seed is part of the private seed
