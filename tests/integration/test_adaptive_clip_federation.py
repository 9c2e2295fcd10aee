"""Adaptive clipping (fedcore.adaptive_clip, fedserver.adaptive_clip) in a real federation over loopback gRPC: every
round's row carries the clip norm it used and the noised unclipped fraction, the clip norm moves toward the update
norms, epsilon per round is the combined mechanism's (against Opacus' own accountant), a stop and resume carries on
bit for bit, and with adaptive clipping off the model is the plain run's bit for bit."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore import privacy
from fedcore.adaptive_clip import COUNT_NOISE
from fedcore.config import ServerConfig
from fedcore.seeds import derive_seed
from fedcore.serialization import load_state
from tests.integration.helpers import run_federation, server_config, stop_then_resume

N = K = 4
ROUNDS = 5
Z, SIGMA_B, DELTA = 0.5, 1.0, 1e-5
Q = K / 8  # dp.population = 8
ADAPTIVE = {"enabled": True, "initial_clip_norm": 0.1, "target_quantile": 0.5, "learning_rate": 1.0,
            "count_noise_std": SIGMA_B, "noise_multiplier": Z}


def _cfg(tmp_path: Path, **sections: dict[str, Any]) -> ServerConfig:
    base: dict[str, dict[str, Any]] = {
        "rounds": {"num_rounds": ROUNDS, "clients_per_round": K, "min_available": N},
        "training": {"local_epochs": 1, "learning_rate": 0.05}, "nfl": {"mode": "off"},
        "aggregation": {"weighted": False}, "dp": {"population": 8, "delta": DELTA}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return server_config(tmp_path, **base)


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]


def _final(tmp_path: Path) -> dict[str, torch.Tensor]:
    return load_state(tmp_path / "run" / "final_model.fgt")[0]


def _federate(cfg: ServerConfig) -> None:
    status: Any = run_federation(cfg, N)[0]  # a FederationStatus (the helper's annotation says dict)
    assert status is not None and status.outcome == "completed"


def _count_draw(round_: int, seed: int = 0) -> float:
    g = torch.Generator().manual_seed(derive_seed(seed, round_, COUNT_NOISE))
    return float(torch.randn((), generator=g, dtype=torch.float64))


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted federation with adaptive clipping (shared by the tests that read it)."""
    path = tmp_path_factory.mktemp("adaptive")
    _federate(_cfg(path, adaptive_clip=ADAPTIVE))
    return path


def test_the_clip_norm_adapts_per_round_and_is_accounted(adaptive_run: Path) -> None:
    rows = _rows(adaptive_run)
    assert [r["round"] for r in rows] == list(range(1, ROUNDS + 1))
    clips = [r["metrics"]["clip_norm"] for r in rows]
    assert clips[0] == 0.1
    for r, nxt in itertools.pairwise(rows):
        assert nxt["metrics"]["clip_norm"] == r["metrics"]["next_clip_norm"]  # the state carried to the next round
    for r in rows:
        m = r["metrics"]
        # b~ = (count + sigma_b * draw(seed, round, "adaptive_clip_count")) / m, and C' = C exp(-eta (b~ - gamma))
        frac = (m["num_unclipped"] + SIGMA_B * _count_draw(r["round"])) / m["num_updates"]
        assert m["noised_unclipped_fraction"] == pytest.approx(frac, rel=1e-12, abs=1e-15)
        assert m["next_clip_norm"] == pytest.approx(m["clip_norm"] * math.exp(-1.0 * (frac - 0.5)), rel=1e-12)
        # the noise on the plain mean of K updates: sigma_r = z_D * C_r / K
        assert m["max_weight_share"] == 1 / K and m["num_updates"] == K
        assert m["noise_sigma"] == pytest.approx(Z / math.sqrt(1 - (Z / (2 * SIGMA_B)) ** 2) * m["clip_norm"] / K,
                                                 rel=1e-12)
    # C starts far below the update norms (every update clipped) and moves toward their median
    norms = [r["metrics"]["update_norm_mean"] for r in rows]
    assert rows[0]["metrics"]["num_unclipped"] == 0
    final = rows[-1]["metrics"]["next_clip_norm"]
    assert abs(math.log(final / norms[-1])) < abs(math.log(clips[0] / norms[0])) - 1.0
    assert final > 3 * clips[0]

    # epsilon per round: the sampled Gaussian mechanism of multiplier z (update and count together), as Opacus has it
    if not privacy.available():
        pytest.skip("the dp extra (Opacus) is not installed: no epsilon is computed (pip install 'fedguard[dp]')")
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for r in rows:
        acc.step(noise_multiplier=Z, sample_rate=Q)
        assert r["dp_noise_multiplier"] == Z and r["dp_sample_rate"] == Q and r["dp_delta"] == DELTA
        assert r["dp_epsilon"] == pytest.approx(acc.get_epsilon(delta=DELTA), rel=1e-9)
    assert [r["dp_epsilon"] for r in rows] == sorted(r["dp_epsilon"] for r in rows)


def test_a_stop_and_resume_carries_the_clip_norm_on_bit_for_bit(tmp_path: Path, adaptive_run: Path) -> None:
    uninterrupted, rows = _final(adaptive_run), _rows(adaptive_run)

    cfg = _cfg(tmp_path / "two", adaptive_clip=ADAPTIVE)
    status = stop_then_resume(cfg, N)
    assert status is not None and status.outcome == "completed" and 2 <= status.resumed_from < ROUNDS
    final = _final(tmp_path / "two")
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)
    assert [r["metrics"]["clip_norm"] for r in _rows(tmp_path / "two")] == [r["metrics"]["clip_norm"] for r in rows]


def test_with_adaptive_clipping_off_the_model_is_the_plain_runs_bit_for_bit(tmp_path: Path) -> None:
    fixed = {"clip_norm": 0.5, "noise_sigma": 0.01}
    _federate(_cfg(tmp_path / "plain", aggregation=fixed))
    # every adaptive key set, but not enabled: nothing of it runs
    _federate(_cfg(tmp_path / "off", aggregation=fixed, adaptive_clip={**ADAPTIVE, "enabled": False}))
    plain, off = _final(tmp_path / "plain"), _final(tmp_path / "off")
    assert all(torch.equal(plain[k], off[k]) for k in plain)
    for a, b in zip(_rows(tmp_path / "plain"), _rows(tmp_path / "off"), strict=True):
        assert "clip_norm" not in b["metrics"] and "num_unclipped" not in b["metrics"]
        assert a["metrics"].keys() == b["metrics"].keys() and a["dp_epsilon"] == b["dp_epsilon"]
