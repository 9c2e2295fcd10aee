"""KD objectives end to end over real gRPC on loopback: the server announces the trainer, HYDRA's shallow heads
are uploaded and aggregated like any parameter, and MOON's previous local model survives a restart of the
clients (and the server) with a bit-identical result."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedclient import ClientConfig, FedClient
from fedcore.config import ServerConfig
from fedcore.report import FederationStatus
from fedcore.serialization import load_state
from fedserver import ServerThread
from tests.integration.helpers import server_config

N = 3
SIDE = 16


def _images(tmp_path: Path) -> Path:
    """A small 10-class image set: each class a noisy bright square at its own place."""
    g = np.random.default_rng(0)
    y = np.repeat(np.arange(10), 30)
    x = g.normal(0.0, 0.3, size=(len(y), 1, SIDE, SIDE)).astype(np.float32)
    for i, c in enumerate(y):
        r, col = divmod(int(c), 5)
        x[i, 0, 2 + 5 * r : 5 + 5 * r, 1 + 2 * col : 3 + 2 * col] += 2.0
    path = tmp_path / "images.npz"
    np.savez(path, x=x, y=y)
    return path


def _config(tmp_path: Path, name: str, model: str, method: str, options: dict[str, Any], rounds: int,
            data: Path) -> ServerConfig:
    return server_config(tmp_path / name,
                         rounds={"num_rounds": rounds, "clients_per_round": N, "min_updates": N, "seed": 2},
                         model={"name": model, "kwargs": {"in_channels": 1, "image_size": SIDE}},
                         data={"dataset": "npz", "options": {"path": str(data), "num_clients": N,
                                                             "partition": "iid"}},
                         training={"batch_size": 10, "learning_rate": 0.05},
                         nfl={"mode": "off"}, recovery={"method": method, "options": options})


def _run(config: ServerConfig, data: Path, state_root: Path | None = None) -> dict[str, torch.Tensor]:
    srv = ServerThread(config, linger_s=0.5).start()
    clients = [FedClient(ClientConfig(insecure=True, server=srv.address, client_id=f"client-{i}", data_index=i,
                                      long_poll_s=5.0, data_options={"path": str(data)},
                                      state_dir=str(state_root / f"c{i}") if state_root else "")).start()
               for i in range(N)]
    status = srv.wait(120)
    for c in clients:
        c.join(30)
    assert isinstance(status, FederationStatus) and status.outcome == "completed", status
    return load_state(Path(config.server.run_dir) / "final_model.fgt")[0]


def test_hydra_heads_are_uploaded_and_aggregated(tmp_path: Path) -> None:
    data = _images(tmp_path)
    hydra = _run(_config(tmp_path, "hydra", "hydra_ntd_cnn", "hydra", {"base": "fedntd"}, 2, data), data)
    ntd = _run(_config(tmp_path, "ntd", "hydra_ntd_cnn", "fedntd", {}, 2, data), data)
    heads0 = [k for k in hydra if k.startswith("heads.0.")]
    heads1 = [k for k in hydra if k.startswith("heads.1.")]
    assert heads0 and heads1
    # Both start from the same seeded model: FedNTD never trains the heads, HYDRA trains (and the server
    # aggregates) its default shallow head, head 1 (after the second conv block, as the authors' code), and
    # leaves head 0 alone.
    assert all(not torch.equal(hydra[k], ntd[k]) for k in heads1)
    assert all(torch.equal(hydra[k], ntd[k]) for k in heads0)


def test_moon_previous_model_survives_a_client_and_server_restart(tmp_path: Path) -> None:
    data = _images(tmp_path)
    options = {"mu": 1.0}
    straight = _run(_config(tmp_path, "straight", "moon_cnn", "moon", options, 4, data), data, tmp_path / "s1")
    _run(_config(tmp_path, "resumed", "moon_cnn", "moon", options, 2, data), data, tmp_path / "s2")
    assert all((tmp_path / "s2" / f"c{i}" / "trainer_state.fgt").exists() for i in range(N))
    # New client objects and a new server on the same state: rounds 3 and 4 use the saved previous models.
    resumed = _run(_config(tmp_path, "resumed", "moon_cnn", "moon", options, 4, data), data, tmp_path / "s2")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    # Without the saved state (fresh clients) round 3 would have no negative: a different model.
    _run(_config(tmp_path, "lost", "moon_cnn", "moon", options, 2, data), data, tmp_path / "s3")
    for i in range(N):
        (tmp_path / "s3" / f"c{i}" / "trainer_state.fgt").unlink()
    lost = _run(_config(tmp_path, "lost", "moon_cnn", "moon", options, 4, data), data, tmp_path / "s3")
    assert any(not torch.equal(straight[k], lost[k]) for k in straight)
