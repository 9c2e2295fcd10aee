"""The round's pipeline over real gRPC on loopback: docs/extending.md's server stage added without editing fedguard,
and the server optimizers' state carried through a stop and resume bit for bit (issue 50)."""

from __future__ import annotations

import importlib
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcore.config import ConfigError, ServerConfig
from fedcore.models import build_model
from fedcore.serialization import load_state
from fedserver import ServerThread
from fedserver.stage import STAGES
from tests.integration.helpers import run_federation, server_config, stop_then_resume
from tests.unit.test_extending import example

N = 3
MODULE = "fedguard_docs_example.server_lr"
# float32's unit roundoff: x + 1·(a − x) and x + η·(a − x) each take two roundings (the difference, then the sum).
U32 = 2.0**-24


def _cfg(tmp_path: Path, rounds: int, **sections: dict[str, Any]) -> ServerConfig:
    base: dict[str, dict[str, Any]] = {
        "rounds": {"num_rounds": rounds, "clients_per_round": N, "min_available": N},
        "training": {"local_epochs": 1, "learning_rate": 0.05}, "nfl": {"mode": "off"}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return server_config(tmp_path, **base)


def _final(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_state(run_dir / "final_model.fgt")[0]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]


def _federate(cfg: ServerConfig) -> dict[str, torch.Tensor]:
    status, _ = run_federation(cfg, N)
    assert status is not None and status.outcome == "completed"
    return _final(Path(cfg.server.run_dir))


@pytest.fixture
def server_lr() -> Iterator[str]:
    """The doc's stage as a module of its own package (not fedguard's), imported by its path."""
    package = types.ModuleType(MODULE.split(".")[0])
    package.__path__ = []
    module = types.ModuleType(MODULE)
    module.__file__ = f"<docs/extending.md: {MODULE}>"
    sys.modules[package.__name__], sys.modules[MODULE] = package, module
    try:
        exec(compile(example("server stage"), module.__file__, "exec"), module.__dict__)
        assert importlib.import_module(MODULE) is module
        yield f"{MODULE}:make_stage"
    finally:
        sys.modules.pop(MODULE, None)
        sys.modules.pop(package.__name__, None)
        if "server_lr" in STAGES:
            STAGES.remove("server_lr")


def test_the_docs_server_stage_runs_in_a_federation(tmp_path: Path, server_lr: str) -> None:
    # One round of plain FedAvg, and the same round through the stage with eta = 0.5 and eta = 1.
    plain = _federate(_cfg(tmp_path / "plain", 1))
    half = _federate(_cfg(tmp_path / "half", 1, pipeline={"stages": [{"name": server_lr, "options": {"lr": 0.5}}]}))
    one = _federate(_cfg(tmp_path / "one", 1, pipeline={"stages": [{"name": server_lr}]}))
    initial = build_model("mlp", {}, seed=0).state_dict()
    for k, a in plain.items():
        if not a.is_floating_point():
            continue
        x = initial[k]
        scale = a.abs() + x.abs()
        assert torch.all((one[k] - a).abs() <= 2 * U32 * scale), k  # x + 1·(a − x) = a to two roundings
        assert torch.all((half[k] - (x + 0.5 * (a - x))).abs() <= 4 * U32 * scale), k
    assert not all(torch.equal(half[k], plain[k]) for k in plain)

    # Several rounds with a decay: every row carries the round's eta, and the stage's state is in the snapshot.
    run = tmp_path / "decay"
    _federate(_cfg(run, 3, pipeline={"stages": [{"name": server_lr, "options": {"lr": 0.8, "decay": 0.5}}]}))
    assert [r["metrics"]["server_lr"] for r in _rows(run / "run")] == [0.8, 0.4, 0.2]


def test_the_docs_server_stage_refuses_a_bad_option_naming_the_field(tmp_path: Path, server_lr: str) -> None:
    cfg = _cfg(tmp_path, 1, pipeline={"stages": [{"name": server_lr, "options": {"decay": 2.0}}]})
    with pytest.raises(ConfigError, match=r"^pipeline\.stages\[0\]\.options\.decay: must be in \(0, 1\], got 2\.0$"):
        ServerThread(cfg).start()
    with pytest.raises(ConfigError, match=r"^pipeline\.stages\[0\]\.name: unknown server stage 'nope'"):
        ServerThread(_cfg(tmp_path / "b", 1, pipeline={"stages": [{"name": "nope"}]})).start()


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedavgm"])
def test_a_server_optimizer_resumes_bit_identically(tmp_path: Path, name: str) -> None:
    opt = {"name": name, "options": {"lr": 0.05} if name != "fedavgm" else {"lr": 1.0, "momentum": 0.9}}
    uninterrupted = _federate(_cfg(tmp_path / "one", 4, server_optimizer=opt))
    rows = _rows(tmp_path / "one" / "run")
    assert [r["metrics"]["server_opt_step"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    assert not all(torch.equal(uninterrupted[k], v) for k, v in _federate(_cfg(tmp_path / "p", 4)).items())

    cfg = _cfg(tmp_path / "two", 4, server_optimizer=opt, server={"address": "127.0.0.1:0"})
    status = stop_then_resume(cfg, N)
    assert status is not None and status.outcome == "completed" and 2 <= status.resumed_from < 4
    final = _final(tmp_path / "two" / "run")
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)

    # Another optimizer on the same run directory is refused, naming the field.
    other = _cfg(tmp_path / "two", 4, server_optimizer={"name": "fedadagrad"})
    with pytest.raises(ConfigError, match=r"^server_optimizer\.name: was "):
        ServerThread(other, linger_s=0.1).start().wait(30)
